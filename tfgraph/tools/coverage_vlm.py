"""The coverage matrix's ``vision-language`` kind: every model type of transformers'
image-text-to-text mapping, measured as a user would.

A vision-language model is measured twice: the claimed kinds (``causal-lm`` …) export its
text decoder from ``input_ids`` as before, and this kind takes it whole, image in and tokens
out. For each model type:

1. built tiny (:func:`tfgraph.tools.tiny_vlm_build.build_family`: the family's config made
   tiny, its own processor with a generated tokenizer, random weights) → else ``not built``;
2. Hugging Face ``generate`` greedy on ``processor(images=random image, text=prompt)`` →
   else ``eager failed``; whether ``AutoProcessor`` reloads the saved directory is noted;
3. exported whole through tfgraph's vision-language export with ``--kv-cache``, then the
   artifact's greedy tokens for the same image and prompt against Hugging Face's →
   ``exported`` with ``tokens_equal``, or the export's failure with its reason. A family
   that export does not take yet (:data:`tfgraph.sources.vision_language.FAMILIES`) is
   ``not exported`` with the reason :data:`NOT_YET`.

:mod:`tfgraph.tools.coverage` runs each row in its own process; the rows' summary and their
section of ``COVERAGE.md`` are here too.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

logger = logging.getLogger(__name__)

KIND = "vision-language"
MAPPING = "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"
NOT_YET = "vision-language export: not yet"
EXPORT_TOKENS = 8  # greedy tokens compared between the artifact and Hugging Face
# one row: build, eager and the export of two small graphs (a family whose tiny config still
# builds a large sub-model, GLM-5-Next's, is stopped sooner than the text rows' 420 s)
TIMEOUT_S = 300


def measure_vlm(model_type: str, cls_name: str, work: Path) -> dict:
    """The row of one image-text-to-text model type; every failure is caught and stated."""
    from tfgraph.errors import first_line
    from tfgraph.tools.tiny_vlm_build import build_family, eager_generate
    from tfgraph.tools.tiny_vlm_families import spec_for

    row: dict = {"model_type": model_type, "kind": KIND, "class": cls_name}
    spec = spec_for(model_type)
    try:
        model, processor = build_family(model_type, work / "hf", spec)
    except Exception as exc:  # the family cannot be made tiny (config, processor or model)
        row.update(status="not built", reason=first_line(exc, named=True))
        return row
    row["parameters"] = sum(p.numel() for p in model.parameters())
    try:
        inputs, tokens = eager_generate(model, processor, spec, EXPORT_TOKENS)
    except Exception as exc:
        row.update(status="eager failed", reason=first_line(exc, named=True))
        return row
    row["eager_tokens"] = tokens
    row["image_tokens"] = int(_image_token_count(inputs, model.config))
    reload = _reloads(work / "hf")
    if reload:
        row["processor_reload"] = reload
    row.update(_export(work, model_type, spec, tokens))
    return row


def _image_token_count(inputs: dict, config) -> int:
    ids = inputs["input_ids"]
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return int((ids == value).sum())
    return 0


def _reloads(directory: Path) -> str | None:
    """None where ``AutoProcessor.from_pretrained`` loads the saved processor, else why not
    (a video processor needs torchvision, which this environment lacks)."""
    import transformers

    from tfgraph.errors import first_line

    try:
        transformers.AutoProcessor.from_pretrained(directory)
    except Exception as exc:
        return f"AutoProcessor does not reload it: {first_line(exc, named=True)}"
    return None


def _export(work: Path, model_type: str, spec: dict, want: list[int]) -> dict:
    """Export the directory whole and compare greedy tokens; :data:`NOT_YET` where this
    checkout has no vision-language export of the family."""
    from tfgraph.errors import first_line

    missing = _not_yet(work / "hf")
    if missing:
        return {"status": "not exported", "reason": missing}
    import tfgraph
    from tfgraph.tools.tiny_vlm_build import IMAGE_HW

    start = time.perf_counter()
    try:
        # the random image's size: a family whose processor's shapes follow it gets that grid
        result = tfgraph.export(str(work / "hf"), work / "out", kv_cache=True, image_size=IMAGE_HW)
    except Exception as exc:
        text = str(exc).lower()
        status = "trace failed" if "trac" in text else "export failed"
        return {"status": status, "reason": first_line(exc, named=True)}
    finally:
        export_s = round(time.perf_counter() - start, 1)
    row: dict = {"status": "exported", "export_s": export_s}
    row["parity"] = bool(result.report["parity"]["passed"])
    try:
        got = _generate_tokens(work / "out", spec, len(want))
    except Exception as exc:
        row.update(tokens_equal=False, tokens_reason=first_line(exc, named=True))
        return row
    row["tokens_equal"] = got == want
    if got != want:
        row["tokens_reason"] = f"artifact {got} vs Hugging Face {want}"
    return row


def _not_yet(directory: Path) -> str | None:
    """Why tfgraph would not export the directory whole (it would export its text decoder
    alone), or None."""
    try:
        from tfgraph.sources.vision_language import FAMILIES, is_vision_language
    except ImportError:
        return NOT_YET
    if is_vision_language(directory):
        return None
    return f"{NOT_YET} for this family (done: {', '.join(sorted(FAMILIES))})"


def _generate_tokens(artifact: Path, spec: dict, new_tokens: int) -> list[int]:
    """The artifact's greedy tokens for the random image and the family's prompt, through
    the artifact's own processor and vision graph."""
    from tfgraph.runtime import CachedDecoder, GenerationConfig, generate
    from tfgraph.runtime.runner import open_runner
    from tfgraph.runtime.vision_language import ImagePrompts
    from tfgraph.tools.tiny_vlm_build import prompt_for, random_image

    images = ImagePrompts(artifact)
    prompts, extra = images.prepare([prompt_for(images.processor, spec)], [random_image()])
    config = GenerationConfig(max_new_tokens=new_tokens, pad_token_id=0)
    decoder = CachedDecoder(open_runner(artifact))
    return list(generate(decoder, prompts, config, extra=extra).tokens[0])


# --- the report ---------------------------------------------------------------------------------


def complete(row: dict) -> bool:
    """Exported whole, its parity passed and its greedy tokens equal Hugging Face's."""
    return (
        row.get("status") == "exported"
        and bool(row.get("tokens_equal"))
        and row.get("parity", True) is not False
    )


def eligible(row: dict) -> bool:
    """Built tiny and ran eagerly with an image: counted in the acceptance figure."""
    return row.get("status") not in ("not built", "eager failed", "crashed", "timeout")


def summarize(rows: list[dict]) -> dict:
    return {
        "architectures": len(rows),
        "built": sum(r.get("status") != "not built" for r in rows),
        "eager": sum(eligible(r) for r in rows),
        "exported": sum(r.get("status") == "exported" for r in rows),
        "complete": sum(complete(r) for r in rows),
        "by_status": dict(Counter(r.get("status", "?") for r in rows)),
    }


def markdown(rows: list[dict], meta: dict | None = None) -> list[str]:
    """``COVERAGE.md``'s vision-language section; ``meta``: the run that measured it."""
    s, meta = summarize(rows), meta or {}
    statuses = ", ".join(f"{k} {v}" for k, v in sorted(s["by_status"].items()))
    lines = [
        "",
        "## Vision-language models, whole (image in, tokens out)",
        "",
        "Every model type of transformers' image-text-to-text mapping, built tiny with its own "
        "processor (a generated tokenizer holding its image tokens), run eagerly with a random "
        f"image (Hugging Face `generate`, {EXPORT_TOKENS} greedy tokens), then exported whole "
        "and its tokens compared. The text decoders of some of them are also rows above "
        "(exported from `input_ids`, the vision tower not traced). See "
        "`tfgraph/tools/coverage_vlm.py`; `python -m tfgraph coverage --kind vision-language` "
        "measures only these rows.",
        "",
        f"Measured {meta.get('date')}: transformers {meta.get('transformers')}, torch "
        f"{meta.get('torch')}, onnxruntime {meta.get('onnxruntime')}; rows at commit "
        f"{', '.join(sorted({str(r.get('measured_at', 'unknown')) for r in rows}))}.",
        "",
        f"- model types: **{s['architectures']}**; built tiny: {s['built']}; ran eagerly with "
        f"an image: **{s['eager']}**; exported whole: {s['exported']}; tokens equal Hugging "
        f"Face: **{s['complete']}** ({100 * s['complete'] / max(s['eager'], 1):.0f}% of those "
        "that ran eagerly)",
        f"- by status: {statuses}",
        "",
        "| model type | class | status | parameters | image tokens | tokens = HF | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        notes = [r.get("reason"), r.get("tokens_reason"), r.get("processor_reload")]
        lines.append(
            "| {} | {} | {} | {} | {} | {} | {} |".format(
                r["model_type"],
                r.get("class", ""),
                r.get("status", "?"),
                r.get("parameters", ""),
                r.get("image_tokens", ""),
                ("yes" if r["tokens_equal"] else "no") if "tokens_equal" in r else "",
                "; ".join(str(n).replace("|", "\\|")[:200] for n in notes if n),
            )
        )
    return lines
