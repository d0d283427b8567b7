"""The artifact stage of ``export``: the graph (and a seq2seq's encoder, split off as a step of
the export's step runner) saved into the staged directory, a Hugging Face directory's tokenizer
files copied, ``manifest.json`` built from the saved graph and written (the runner reads it
before parity runs). ``options`` is the ``saving`` view."""

from __future__ import annotations

import shutil
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from tfgraph.contract import ENCODER_FILE
from tfgraph.exporters.artifact import write_json
from tfgraph.exporters.compile import count_fusions
from tfgraph.exporters.flavours import get_flavour
from tfgraph.exporters.manifest import MANIFEST_FILE, build_manifest
from tfgraph.exporters.onnx_file import save_onnx
from tfgraph.passes.cache.split_encoder import split_encoder


class Saved(NamedTuple):
    manifest: dict
    files: list[str]  # the artifact's files, the step graph first
    fusions: dict  # the per-layer fusion report of the graph as saved


def split(graph, options, steps):
    """With a KV cache, an encoder-decoder's encoder split off ``graph`` (it runs once per
    prompt): the encoder graph, or None for a decoder."""
    if not options.kv_cache:
        return None
    encoder = steps.run(
        "SplitEncoderPass",
        lambda: split_encoder(graph),
        graph,
        exact=None,
        changed=lambda e: e is not None,
    )
    if encoder is not None:
        steps.check(encoder, "SplitEncoderPass")
    return encoder


def write_artifact(graph, stage: Path, source, options, steps, encoder=None):
    """(manifest, files, fusions): ``graph`` (and ``encoder``) saved into ``stage`` as the
    target's artifact; the manifest says what was done to it (``steps.records``) and what
    fused (``fusions``, counted once, on the graph as saved)."""
    target = options.target
    flavour = get_flavour(options.flavour)
    files: list[str] = []
    if encoder is not None:
        # beside the step graph, where the runtime looks for it (a flavour's folder too)
        beside = str(PurePosixPath(flavour.model_file).with_name(ENCODER_FILE))
        files += save_onnx(encoder, stage, external_data=options.external_data, name=beside)
    if "/" in flavour.model_file:
        (stage / flavour.model_file).parent.mkdir(parents=True, exist_ok=True)
    files = (
        save_onnx(graph, stage, external_data=options.external_data, name=flavour.model_file)
        + files
    )
    files += source.save_tokenizer(stage) or copy_tokenizer(source.origin, stage)
    fusions = count_fusions(graph, options.pipeline, target=target)
    if encoder is not None:  # the model's fusions: the encoder's layers count too
        fusions = _merged(count_fusions(encoder, options.pipeline, target=target), fusions)
    manifest = build_manifest(
        graph,
        kv_cache=options.kv_cache,
        origin=source.origin,
        pipeline=options.pipeline,
        target=target,
        passes=[r.as_dict() for r in steps.records],
        fusions=fusions,
        files=files,
        max_positions=source.info.get("max_positions"),
        encoder=encoder,
    )
    manifest["precision"] = options.precision
    manifest["target"]["runner"] = target.runner_for(options.precision)
    manifest["flavour"] = flavour.name
    if source.info.get("static_axes"):  # axes fixed by --static-axes: name → the size taken
        manifest["static_axes"] = source.info["static_axes"]
    manifest["files"] += flavour.write(stage, graph, source, manifest, options)
    write_json(stage / MANIFEST_FILE, manifest)
    return Saved(manifest, files, fusions)


def _merged(first: dict, second: dict) -> dict:
    """Two graphs' fusion reports as one (counts added, lists joined in graph order)."""
    out = {}
    for kind in [*first, *(k for k in second if k not in first)]:
        a, b = first.get(kind, {}), second.get(kind, {})
        out[kind] = {
            k: (a.get(k, 0) + b.get(k, 0))
            if isinstance(a.get(k, b.get(k)), int)
            else (list(a.get(k, [])) + list(b.get(k, [])))
            for k in [*a, *(k for k in b if k not in a)]
        }
    return out


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",  # where transformers >= 4.43 saves a tokenizer's chat template
    "chat_template.json",
)


def copy_tokenizer(origin: str, stage: Path) -> list[str]:
    """A Hugging Face directory's tokenizer files go into ``tokenizer/`` (for ``generate
    --text``); their contents are data, never code."""
    if not origin.startswith("hf:"):
        return []
    directory = Path(origin[3:])
    found = [directory / n for n in TOKENIZER_FILES if (directory / n).is_file()]
    if not found:
        return []
    (stage / "tokenizer").mkdir()
    for path in found:
        shutil.copyfile(path, stage / "tokenizer" / path.name)
    return [f"tokenizer/{p.name}" for p in found]
