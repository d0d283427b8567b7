"""``export``: source → trace → compile → precision → artifact → verify, as one atomic artifact.

An artifact directory holds ``model.onnx`` (plus ``model.onnx.data`` past 2 GB),
``manifest.json`` and ``report.json``. It is staged beside the target and renamed into place
only when complete; a failure at any step leaves no output directory behind. A model whose
parity fails is still written (its report says why), and :attr:`ExportResult.passed` is False.
Each stage lives in the subpackage named for it (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tfgraph.exporters import check_target, staged_directory, write_json
from tfgraph.exporters.artifact import scratch_directory
from tfgraph.exporters.budget import check_budget
from tfgraph.exporters.compile import count_fusions, run_pipeline
from tfgraph.exporters.manifest import MANIFEST_FILE, build_manifest
from tfgraph.exporters.ort.paging import page_artifact
from tfgraph.exporters.targets import get_target
from tfgraph.exporters.write import write_artifact
from tfgraph.interrupts import unwound
from tfgraph.options import ExportOptions
from tfgraph.precision.stage import convert_precision, quantize_kv_cache, quantize_weights
from tfgraph.progress import stage
from tfgraph.sources import ModelSource, load_source
from tfgraph.sources.trace import TraceCache
from tfgraph.sources.tracing import trace_source
from tfgraph.verify.artifact import check_artifact, weights_error
from tfgraph.verify.kv_quantization import check_int8_cache

logger = logging.getLogger(__name__)


@dataclass
class ExportResult:
    out_dir: Path
    manifest: dict
    report: dict

    @property
    def passed(self) -> bool:
        return self.report["parity"]["passed"]


def _no_progress(step: str) -> None:
    pass


class Stages:
    """Runs the stages of one export: tells ``progress`` as each starts, times each."""

    def __init__(self, progress: Callable[[str], None]) -> None:
        self.progress = progress
        self.timings: dict[str, float] = {}

    def run(self, name: str, fn, *args, **kwargs):
        self.progress(name)
        start = time.perf_counter()
        with stage(name):  # a listener (the CLI) sees it start, tick and end
            value = fn(*args, **kwargs)
        self.timings[name] = round(time.perf_counter() - start, 3)
        logger.info("%s: %.2f s", name, self.timings[name])
        return value


@unwound  # SIGINT, SIGTERM and SIGHUP unwind: nothing is left behind
def export(
    model: str | ModelSource,
    out_dir: str | Path,
    options: ExportOptions | None = None,
    *,
    progress: Callable[[str], None] = _no_progress,
    trace_cache: TraceCache | None = None,
    **fields,
) -> ExportResult:
    """Export ``model`` (a MODEL string as the CLI takes it, or a :class:`ModelSource`) into
    ``out_dir`` with ``options`` (:class:`tfgraph.options.ExportOptions`), or the same fields
    as keyword arguments (``profile`` is the old name of ``target``). ``trace_cache`` reuses an
    earlier export's trace of the same source and opset."""
    out_dir = Path(out_dir)
    options = ExportOptions.of(options, fields)
    target = get_target(options.target)  # an unknown target is refused first
    check_target(out_dir)  # before any slow work
    options = options.resolved(target)
    stages = Stages(progress)

    source = model if isinstance(model, ModelSource) else stages.run("load", _load, model, options)
    budget = check_budget(source, options, out_dir)  # disk and memory, before the slow work
    source, graph = stages.run("trace", trace_source, model, source, options, trace_cache)
    shapes = _within(options.parity_shapes, source.info.get("max_positions"))
    with staged_directory(out_dir) as stage, contextlib.ExitStack() as cleanup:
        records = stages.run("passes", _compile, graph, source, options, stage)
        precision = weights = None
        reference = source
        if options.precision != "fp32":
            precision = stages.run(
                "precision", convert_precision, graph, source, options, shapes, records
            )
        if options.weights is not None:
            graph, weights, reference = stages.run(
                "weights", quantize_weights, graph, source, options, records
            )
        kv_reference = None
        if options.kv_dtype != "fp32":
            scratch = cleanup.enter_context(scratch_directory(out_dir.parent, "kv"))
            kv_quant, kv_reference = stages.run(
                "kv cache", quantize_kv_cache, graph, source, options, shapes, records, scratch
            )
        fusions = count_fusions(graph, options.pipeline, target=options.target)
        passes = [r.as_dict() for r in records]
        manifest, files = stages.run(
            "save", write_artifact, graph, stage, source, options, passes, fusions
        )
        if kv_reference is not None:  # an int8 cache: the bound measured on its reference
            parity = stages.run(
                "parity", check_int8_cache, reference, stage / files[0], kv_reference, options,
                shapes,
            )  # fmt: skip
        else:
            parity = stages.run(
                "parity", check_artifact, reference, stage / files[0], options, shapes
            )
        paged = None
        if options.kv_layout == "paged" and parity["passed"]:  # parity ran on the GQA graph
            paged = stages.run(
                "paging", page_artifact, graph, stage, options,
                lambda g: _resave(g, stage, files[0], manifest, options),
            )  # fmt: skip
            manifest = paged["manifest"]
            fusions = count_fusions(graph, options.pipeline, target=options.target)
        report = _report(source, options, graph, manifest, parity, fusions, passes, stages)
        report["kv_layout"] = options.kv_layout
        if paged is not None:
            report["paged"] = paged["report"]
        report["precision"] = precision or {"precision": "fp32"}
        report["weights"] = weights
        report["kv_dtype"] = options.kv_dtype
        if kv_reference is not None:
            report["kv_quantization"] = kv_quant
        report["budget"] = budget
        if weights is not None:
            weights["error_vs_fp32"] = stages.run(
                "quantization error", weights_error, source, reference, stage / files[0],
                options, shapes,
            )  # fmt: skip
        write_json(stage / "report.json", report)
    return ExportResult(out_dir, manifest, report)


def _resave(graph, stage: Path, name: str, manifest: dict, options: ExportOptions) -> dict:
    """The step graph saved again over ``name`` (its weights where the first save put them)
    and the manifest's signature, layout and fusions rebuilt from it."""
    import onnx_ir as ir

    ir.save(graph, stage / name)
    fresh = build_manifest(
        graph, kv_cache=True, origin=manifest["model"], pipeline=options.pipeline,
        target=options.target, passes=manifest["passes"],
        fusions=count_fusions(graph, options.pipeline, target=options.target),
        files=manifest["files"], max_positions=manifest["max_positions"],
    )  # fmt: skip
    updated = dict(manifest)
    for key in ("inputs", "outputs", "kv_layout", "opsets", "fusions"):
        updated[key] = fresh[key]
    updated["graphs"] = {**manifest["graphs"], name: fresh["graphs"][name]}
    write_json(stage / MANIFEST_FILE, updated)
    return updated


def _load(model: str, options: ExportOptions) -> ModelSource:
    return load_source(
        model,
        trust_remote_code=options.trust_remote_code,
        attn_implementation=options.attn_implementation,
    )


def _compile(graph, source: ModelSource, options: ExportOptions, stage: Path):
    return run_pipeline(
        graph,
        options.pipeline,
        target=options.target,
        check_each_pass=options.check_each_pass,
        dump_after=options.dump_after,
        dump_dir=stage,
        kv_cache=options.kv_cache,
        max_positions=source.info.get("max_positions"),
        row_lengths=options.row_lengths,
    )


def _report(source, options, graph, manifest, parity, fusions, passes, stages) -> dict:
    target = options.target
    return {
        "model": source.origin,
        "source": source.info,
        "parity": parity,
        "fusions": fusions,
        "kv_cache": options.kv_cache,
        "profile": target.label,
        "target": manifest["target"],
        "opset": graph.opset_imports.get("", options.opset),
        "pipeline": options.pipeline,
        "precision": None,
        "weights": None,
        "compatibility": target.compatibility(graph),  # e.g. TensorRT's parser, statically
        "passes": passes,
        "timings": stages.timings,
    }


def _within(shapes, max_positions: int | None):
    """Parity shapes inside the model's position limit (a model with 16 learned positions is
    checked at 16, not at the default 33)."""
    if not max_positions:
        return shapes
    return tuple((batch, min(seq, max_positions)) for batch, seq in shapes)
