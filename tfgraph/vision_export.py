"""``export`` of a vision-language directory (:func:`tfgraph.sources.vision_language
.is_vision_language`): its graphs, each exported as any model is, into one artifact.

::

    OUT/
      manifest.json       the artifact's: the decoder's entries (its step graph first in
                          ``files``, its KV layout, target), every graph's signature under
                          ``graphs``, and ``vision_language`` (image token, image size, the
                          image processor's settings)
      report.json         the decoder's report; fusions and parity cover both graphs
      vision/             pixel_values → image_features: its own artifact (model.onnx,
                          manifest.json, report.json), exported without a cache
      decoder/            input_ids, attention_mask, image_features → logits, with the KV
                          cache when asked (model.onnx, manifest.json, report.json, tokenizer/)
      tokenizer/          the directory's tokenizer files (``generate --text``)
      processor/          the processor's files with the tokenizer's (``AutoProcessor``)

Each graph gets the export's parity (the decoder's cached one included) against its eager
module. The whole directory is staged and appears only when both graphs are written.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from tfgraph.errors import TfgraphError
from tfgraph.exporters import staged_directory, write_json
from tfgraph.exporters.write import TOKENIZER_FILES, _merged, copy_tokenizer
from tfgraph.options import ExportOptions
from tfgraph.sources.vision_language import image_processor_settings, load_vision_language

logger = logging.getLogger(__name__)

GRAPHS = ("decoder", "vision")  # the decoder first: its step graph is the artifact's
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", *TOKENIZER_FILES)


def export_vision_language(
    export: Callable, model, out_dir, options: ExportOptions | None = None, *, progress, **fields
):
    """The artifact of the vision-language directory ``model`` (module doc); ``export``:
    :func:`tfgraph.exporting.export`, which exports each graph (handed in: no import circle)."""
    out_dir, options = Path(out_dir), ExportOptions.of(options, fields)
    if options.flavour != "tfgraph":
        raise TfgraphError(
            f"--flavour {options.flavour} lays out text decoders only; export a "
            "vision-language model with the default flavour"
        )
    path = Path(model)
    if image_processor_settings(path) is None:
        logger.warning(
            "%s has no image processor (preprocessor_config.json or processor_config.json): "
            "the artifact carries no processor, so "
            "generate --image cannot prepare images (save the model's processor beside it: "
            "processor.save_pretrained(DIR))",
            path,
        )
    loading = dataclasses.asdict(options.view("loading"))
    vlm = load_vision_language(path, **loading, image_size=parse_image_size(options.image_size))
    # the image size is the probe's (above): neither graph's export reads it
    per_graph = {
        "vision": _vision_options(options),
        "decoder": dataclasses.replace(options, image_size=None),
    }
    sources = {"vision": vlm.vision, "decoder": vlm.decoder}
    with staged_directory(out_dir) as stage:
        results = {
            name: export(sources[name], stage / name, per_graph[name], progress=progress)
            for name in GRAPHS
        }
        files = [f"{name}/{f}" for name in GRAPHS for f in _files(results[name])]
        files += copy_tokenizer(f"hf:{path}", stage) + _copy_processor(path, stage)
        manifest = _manifest(results, files, vlm, path)
        report = _report(results)
        write_json(stage / "manifest.json", manifest)
        write_json(stage / "report.json", report)
    decoder = results["decoder"]
    return type(decoder)(out_dir, manifest, report)


# what concerns a KV cache or a token axis: the vision graph has neither (defaults there)
_DECODER_ONLY = (
    "image_size",
    "kv_cache",
    "kv_dtype",
    "kv_scales",
    "kv_layout",
    "kv_block_size",
    "static_axes",
)


def _vision_options(options: ExportOptions) -> ExportOptions:
    defaults = ExportOptions()
    names = {f.name for f in dataclasses.fields(options)}
    kept = {n: getattr(defaults, n) for n in _DECODER_ONLY if n in names}
    return dataclasses.replace(options, **kept)


def parse_image_size(value) -> tuple[int, int] | None:
    """``--image-size``: "HxW" (or "S" for a square), or a pair; None stays None."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        parts = value.lower().split("x")
        if len(parts) == 1:
            parts = parts * 2
    else:
        parts = list(value)
    try:
        size = tuple(int(v) for v in parts)
    except (TypeError, ValueError):
        size = ()
    if len(size) != 2 or min(size) < 1:
        raise TfgraphError(f"--image-size '{value}' is not HEIGHTxWIDTH (e.g. 448x448)")
    return size


def _files(result) -> list[str]:
    return [*result.manifest["files"], "manifest.json", "report.json"]


def _copy_processor(path: Path, stage: Path) -> list[str]:
    """The processor's files (and the tokenizer's, which ``AutoProcessor`` loads with them)
    into ``processor/``; their contents are data, never code."""
    if image_processor_settings(path) is None:
        return []
    found = [path / n for n in PROCESSOR_FILES if (path / n).is_file()]
    (stage / "processor").mkdir()
    for file in found:
        shutil.copyfile(file, stage / "processor" / file.name)
    return [f"processor/{f.name}" for f in found]


def _manifest(results: dict, files: list[str], vlm, path: Path) -> dict:
    """The decoder's manifest, with every file and graph of the artifact and the
    ``vision_language`` entry."""
    manifest = dict(results["decoder"].manifest)
    graphs = {}
    for name in GRAPHS:
        for file, signature in results[name].manifest["graphs"].items():
            graphs[f"{name}/{file}"] = signature
    fusions = {name: results[name].manifest["fusions"] for name in GRAPHS}
    merged = _merged(results["decoder"].report["fusions"], results["vision"].report["fusions"])
    manifest.update(
        model=f"hf:{path}",
        files=files,
        graphs=graphs,
        fusions={k: {"fused": v["fused"], "total": v["total"]} for k, v in merged.items()},
        vision_language={
            **vlm.settings(),
            "graphs": {name: f"{name}/{results[name].manifest['files'][0]}" for name in GRAPHS},
            "fusions": fusions,
            "merged_in": "the decoder: the k-th image token of a row takes its feature k",
            "processor": "processor/" if any(f.startswith("processor/") for f in files) else None,
        },
    )
    return manifest


def _report(results: dict) -> dict:
    """The decoder's report (what the CLI prints), with both graphs' fusions and parity: it
    passes when both do; each graph's whole report is in its own folder."""
    vision, decoder = results["vision"].report, results["decoder"].report
    report = dict(decoder)  # "model": the decoder's source (python -m tfgraph parity DIR)
    report["fusions"] = _merged(decoder["fusions"], vision["fusions"])
    report["parity"] = {
        **decoder["parity"],
        "passed": bool(vision["parity"]["passed"] and decoder["parity"]["passed"]),
        "graphs": {"vision": vision["parity"], "decoder": decoder["parity"]},
    }
    report["graphs"] = {
        name: {key: results[name].report[key] for key in ("fusions", "timings")} for name in GRAPHS
    }
    return report
