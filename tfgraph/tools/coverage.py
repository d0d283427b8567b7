"""The coverage matrix: every architecture of the installed transformers that can be made tiny
from its config, exported the way a user would, and measured.

For each model type in transformers' auto mappings (causal LMs, sequence-to-sequence LMs,
speech encoder-decoders, text encoders, vision and speech encoders):

1. a tiny config (:mod:`tfgraph.tools.tiny_configs`: 2 layers, width 64, 4 heads, vocabulary
   512 …, set only where the default config has the attribute, then rebuilt so derived
   fields follow; a composite config's sub-configs — a multimodal model's ``text_config`` and
   ``vision_config``, T5Gemma's ``encoder``/``decoder`` — made tiny the same way, each
   rebuilt from its own class), random weights, ``save_pretrained`` into a temporary
   directory;
2. ``export`` with the default pipeline: status, attention and norm fused/total with every miss
   reason, parity;
3. decoders (causal and seq2seq LMs): ``export --kv-cache``, then 32 greedy tokens for two
   left-padded prompts with :func:`tfgraph.runtime.generate` against Hugging Face
   ``model.generate`` (no processors: a plain greedy config); speech encoder-decoders against
   eager greedy decoding, since Whisper's ``generate`` post-processes its output.

Each architecture runs in its own process (bounded memory, a timeout, a crash is a row); the
JSON is written after every row, so a run resumes where it stopped. ``python -m tfgraph
coverage --out docs`` writes ``docs/coverage.json`` and ``docs/COVERAGE.md``. The token
check is in :mod:`tfgraph.tools.coverage_generation`, the report (complete rows, summary,
``COVERAGE.md``) in :mod:`tfgraph.tools.coverage_report`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tfgraph.tools import coverage_vlm
from tfgraph.tools.coverage_generation import greedy_vs_hf
from tfgraph.tools.coverage_report import DECODER_KINDS, environment, markdown, summarize
from tfgraph.tools.tiny_configs import (  # noqa: F401 - re-exported
    SPECIAL_TOKENS,
    TINY,
    TINY_BY_MODEL,
    config_for,
    tiny_config,
)

logger = logging.getLogger(__name__)

KINDS = (
    "causal-lm",
    "seq2seq-lm",
    "speech-seq2seq",
    "encoder",
    "vision",
    "speech-encoder",
    coverage_vlm.KIND,
)
# the order a model type is claimed in: encoder-decoders before their decoder-only heads
# (WhisperForCausalLM, BartForCausalLM), text encoders before their causal-LM heads
_CLAIM_ORDER = ("speech-seq2seq", "seq2seq-lm", "encoder", "causal-lm", "vision", "speech-encoder")
_MAPPINGS = {  # kind: transformers auto mapping (model_type → class name)
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "encoder": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "vision": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "speech-encoder": "MODEL_FOR_CTC_MAPPING_NAMES",
    coverage_vlm.KIND: coverage_vlm.MAPPING,
}
# not claimed: every image-text-to-text model type is also a vision-language row (taken
# whole, image in), beside the row of the kind that claims it (its text decoder from input_ids)
_UNCLAIMED = (coverage_vlm.KIND,)
NO_ATTENTION = "no attention"  # exported, but not a transformer (a ConvNet, a state-space LM)
TIMEOUT_S = 420  # one architecture, both exports and generation

EAGER_FAILED = "eager failed"  # the tiny model does not run on inputs from its own config


def architectures(
    only: Iterable[str] | None = None, kinds: Iterable[str] | None = None
) -> list[tuple[str, str, str]]:
    """(model_type, kind, class name) for every architecture of the installed transformers;
    a model type counts once among the kinds of :data:`_CLAIM_ORDER`, in the first that lists
    it (text encoders that also have a causal-LM head count as encoders, Whisper as a speech
    encoder-decoder), and once more in each kind of :data:`_UNCLAIMED` that lists it (a
    vision-language model whole). ``only``: these model types; ``kinds``: these kinds."""
    from transformers.models.auto import modeling_auto

    seen: dict[tuple[str, str], tuple[str, str, str]] = {}
    claimed: set[str] = set()
    for kind in (*_CLAIM_ORDER, *_UNCLAIMED):
        for model_type, cls in getattr(modeling_auto, _MAPPINGS[kind]).items():
            if kind in _CLAIM_ORDER and model_type in claimed:
                continue
            claimed.add(model_type)
            if isinstance(cls, (tuple, list)):
                cls = cls[0]
            seen[model_type, kind] = (model_type, kind, cls)
    rows = sorted(seen.values(), key=lambda r: (KINDS.index(r[1]), r[0]))
    if only:
        wanted = set(only)
        rows = [r for r in rows if r[0] in wanted]
    if kinds:
        wanted_kinds = set(kinds)
        rows = [r for r in rows if r[1] in wanted_kinds]
    return rows


# --- one architecture (in its own process) ----------------------------------------------------


def measure(model_type: str, kind: str, cls_name: str, work: Path) -> dict:
    """The row of one architecture; every failure is caught and stated with its message."""
    import torch
    import transformers

    import tfgraph
    from tfgraph.errors import first_line
    from tfgraph.sources.trace import TraceCache

    if kind == coverage_vlm.KIND:
        return coverage_vlm.measure_vlm(model_type, cls_name, work)
    row: dict = {"model_type": model_type, "kind": kind, "class": cls_name}
    try:
        cls = getattr(transformers, cls_name)
        config = config_for(cls, tiny_config(model_type, kind))
        torch.manual_seed(0)
        model = cls(config).eval()
        _untie_zero_weights(model)
        model.save_pretrained(work / "hf")
    except Exception as exc:  # the architecture cannot be built tiny from its config
        row.update(status="not built", reason=first_line(exc, named=True))
        return row
    row["parameters"] = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    traces = TraceCache(by_origin=True)  # the cached export reuses the plain one's trace
    try:
        result = tfgraph.export(str(work / "hf"), work / "plain", trace_cache=traces)
    except Exception as exc:  # a trace failure is the row's finding
        row.update(status=_failure(exc), reason=first_line(exc, named=True))
        return row
    finally:
        row["export_s"] = round(time.perf_counter() - start, 1)
    _fill(row, result.report)
    if not row["parity"]:  # before any tfgraph pass too? then the translation is the cause
        try:
            raw = tfgraph.export(
                str(work / "hf"), work / "untouched", pipeline="none", trace_cache=traces
            )
            row["parity_without_passes"] = bool(raw.report["parity"]["passed"])
        except Exception as exc:  # noqa: BLE001 - the diagnostic only
            row["parity_without_passes_error"] = first_line(exc, named=True)
    # a recurrent layer (linear attention, a state-space scan) mixes tokens as attention does
    mixes = row["attention"][1] + row["recurrent"][1]
    row["status"] = "exported" if mixes else NO_ATTENTION
    if kind not in DECODER_KINDS or not mixes:
        return row
    try:
        cached = tfgraph.export(
            str(work / "hf"), work / "cached", kv_cache=True, trace_cache=traces
        )
    except Exception as exc:
        row.update(kv_cache=False, kv_reason=first_line(exc, named=True))
        return row
    row["kv_cache"] = True
    row["kv_parity"] = bool(cached.report["parity"]["passed"])
    try:
        row.update(greedy_vs_hf(work, model, kind))
    except Exception as exc:
        row.update(tokens_equal=False, tokens_reason=first_line(exc, named=True))
    return row


def _untie_zero_weights(model) -> None:
    """Router matrices initialized to exactly zero drawn at random (std 0.02). AFMoE
    zero-inits its router: every expert then ties, and each runtime's top-k breaks the tie its
    own way, so eager and ONNX Runtime route differently on a model no checkpoint looks like.
    Only routers: other zero-initialized projections (NeoMME's o_proj and down_proj) are part
    of a model's design, and drawn at random its activations overflow."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            router = "router" in name or name.endswith("gate.weight")
            if router and param.dim() >= 2 and param.numel() and not param.any():
                param.normal_(0.0, 0.02)


def _failure(exc: Exception) -> str:
    if "fails on inputs derived from its config" in str(exc):
        return EAGER_FAILED
    text = str(exc).lower()
    if "tracing" in text or "torch.export" in text or "cannot trace" in text:
        return "trace failed"
    return "export failed"


def _fill(row: dict, report: dict) -> None:
    fusions = report["fusions"]
    for family in ("attention", "norm", "recurrent"):
        entry = fusions.get(family, {})
        row[family] = [entry.get("fused", 0), entry.get("total", 0)]
        missed = entry.get("missed", [])
        if missed:
            row[f"{family}_missed"] = sorted(
                {m.get("reason", str(m)) if isinstance(m, dict) else str(m) for m in missed}
            )
    parity = report["parity"]
    row["parity"] = bool(parity["passed"])
    row["max_abs_err"] = max(o["max_abs_err"] for o in parity["outputs"])
    row["main_input"] = report["source"].get("main_input")
    if report["source"].get("attn_fallback"):
        row["attn_fallback"] = report["source"]["attn_fallback"]


def _worker(argv: list[str]) -> int:
    """The row's process. Its working directory belongs to the parent, which removes it even
    when this process is killed (a timeout, the kernel's OOM killer): a killed worker cannot
    leave gigabytes of checkpoints and ONNX files in the temporary directory."""
    model_type, kind, cls_name, out, work = argv
    logging.basicConfig(level=logging.ERROR)
    row = measure(model_type, kind, cls_name, Path(work))
    Path(out).write_text(json.dumps(row))
    return 0


# --- the whole matrix ---------------------------------------------------------------------------


def run_one(model_type: str, kind: str, cls_name: str, timeout: float = TIMEOUT_S) -> dict:
    """One architecture in a fresh process; a timeout or a crash is a row too."""
    with tempfile.TemporaryDirectory(prefix=f"cov-{model_type}-") as tmp:
        out, work = Path(tmp) / "row.json", Path(tmp) / "work"
        work.mkdir()
        args = [model_type, kind, cls_name, str(out), str(work)]
        cmd = [sys.executable, "-m", "tfgraph.tools.coverage", *args]
        # the worker's own temporary files (libraries' scratch) land in the same directory
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "TMPDIR": str(work),
        }
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {
                "model_type": model_type,
                "kind": kind,
                "class": cls_name,
                "status": "timeout",
                "reason": f"over {timeout:.0f} s",
                "seconds": round(time.perf_counter() - start, 1),
            }
        if out.is_file():
            row = json.loads(out.read_text())
        else:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            row = {
                "model_type": model_type,
                "kind": kind,
                "class": cls_name,
                "status": "crashed",
                "reason": f"exit {done.returncode}: {tail[:300]}",
            }
        row["seconds"] = round(time.perf_counter() - start, 1)
        return row


def run(
    out_dir: Path,
    *,
    only: Iterable[str] | None = None,
    kinds: Iterable[str] | None = None,
    jobs: int = 1,
    limit: int | None = None,
    progress: Callable[[dict, int, int], None] | None = None,
    fresh: bool = False,
) -> dict:
    """Measure every architecture (or ``only`` these model types, of these ``kinds``),
    ``jobs`` at a time; rows already in ``out_dir/coverage.json`` are kept unless ``fresh``
    (then only the rows measured again are replaced)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "coverage.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    rows = {(r["model_type"], r["kind"]): r for r in data.get("rows", [])}
    todo = [a for a in architectures(only, kinds) if fresh or (a[0], a[1]) not in rows]
    if limit is not None:
        todo = todo[:limit]
    meta = {**environment(), "known": len(architectures(only))}
    if kinds and data.get("meta"):  # some kinds only: the other rows' header stays theirs
        data["meta"]["known"] = meta["known"]
        data["meta_kinds"] = {**meta, "kinds": sorted(kinds)}
    else:
        data["meta"] = meta
    total = len(todo)

    def one(arch):
        timeout = coverage_vlm.TIMEOUT_S if arch[1] == coverage_vlm.KIND else TIMEOUT_S
        return {**run_one(*arch, timeout=timeout), "measured_at": meta["commit"]}

    def write() -> None:
        order = sorted(rows.values(), key=lambda r: (KINDS.index(r["kind"]), r["model_type"]))
        data["rows"] = order
        data["summary"] = summarize([r for r in order if r["kind"] != coverage_vlm.KIND])
        vlm = [r for r in order if r["kind"] == coverage_vlm.KIND]
        if vlm:
            data["summary_vision_language"] = coverage_vlm.summarize(vlm)
        path.write_text(json.dumps(data, indent=1))
        (out_dir / "COVERAGE.md").write_text(markdown(data))

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for i, row in enumerate(pool.map(one, todo), 1):
            rows[row["model_type"], row["kind"]] = row
            write()
            if progress is not None:
                progress(row, i, total)
    write()
    return data


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
