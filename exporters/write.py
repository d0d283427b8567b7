"""The artifact stage of ``export``: the graph (and a seq2seq's encoder) saved into the staged
directory, a Hugging Face directory's tokenizer files copied, ``manifest.json`` written (the
runner reads it before parity runs)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tfgraph.contract import ENCODER_FILE
from tfgraph.exporters.artifact import write_json
from tfgraph.exporters.compile import check_model
from tfgraph.exporters.manifest import MANIFEST_FILE, build_manifest
from tfgraph.exporters.onnx_file import save_onnx
from tfgraph.passes.cache.split_encoder import split_encoder


def write_artifact(graph, stage: Path, source, options, passes: list[dict], fusions: dict):
    """(manifest, files): ``graph`` saved into ``stage`` as the target's artifact; with a KV
    cache, an encoder-decoder's encoder split into its own file (it runs once per prompt)."""
    target = options.target
    files: list[str] = []
    encoder = None
    if options.kv_cache:
        encoder = split_encoder(graph)
        if encoder is not None:
            check_model(encoder, "split_encoder", target)
            check_model(graph, "split_encoder", target)
            files += save_onnx(
                encoder, stage, external_data=options.external_data, name=ENCODER_FILE
            )
    files = save_onnx(graph, stage, external_data=options.external_data) + files
    files += copy_tokenizer(source.origin, stage)
    manifest = build_manifest(
        graph,
        kv_cache=options.kv_cache,
        origin=source.origin,
        pipeline=options.pipeline,
        target=target,
        passes=passes,
        fusions=fusions,
        files=files,
        max_positions=source.info.get("max_positions"),
        encoder=encoder,
    )
    manifest["precision"] = options.precision
    manifest["target"]["runner"] = target.runner_for(options.precision)
    write_json(stage / MANIFEST_FILE, manifest)
    return manifest, files


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
