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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tfgraph.exporters import check_target, staged_directory, write_json
from tfgraph.exporters.artifact import scratch_directory
from tfgraph.exporters.budget import check_budget
from tfgraph.exporters.flavours import get_flavour
from tfgraph.exporters.ort.paging import page, paged_report
from tfgraph.exporters.targets import get_target
from tfgraph.exporters.write import split, write_artifact
from tfgraph.interrupts import unwound
from tfgraph.options import ExportOptions
from tfgraph.passes.pipeline.run import Steps
from tfgraph.precision.stage import convert_precision, quantize_kv_cache, quantize_weights
from tfgraph.progress import stage
from tfgraph.sources import ModelSource, load_source
from tfgraph.sources.objects import with_tokenizer
from tfgraph.sources.static_axes import parity_shapes
from tfgraph.sources.trace import TraceCache
from tfgraph.sources.tracing import trace_source
from tfgraph.sources.vision_language import is_vision_language
from tfgraph.verify.artifact import check_artifact, weights_error
from tfgraph.verify.kv_quantization import check_int8_cache
from tfgraph.verify.quality import check_measurable, measure_quality
from tfgraph.vision_export import export_vision_language

if TYPE_CHECKING:
    from torch.nn import Module

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
    """The stages of one export: tells ``progress`` as each starts, times each."""

    def __init__(self, progress: Callable[[str], None]) -> None:
        self.progress = progress
        self.timings: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, name: str):
        self.progress(name)
        start = time.perf_counter()
        with stage(name):  # a listener (the CLI) sees it start, tick and end
            yield
        self.timings[name] = round(self.timings.get(name, 0) + time.perf_counter() - start, 3)
        logger.info("%s: %.2f s", name, self.timings[name])


@dataclass
class Rewritten:
    """What the steps after the pipeline did: their report entries, and the eager model the
    artifact must compute (the source, or its dequantized copy; an int8 cache's reference)."""

    reference: object
    precision: dict | None = None
    weights: dict | None = None
    kv_quantization: dict | None = None
    kv_reference: Path | None = None
    paged: dict | None = None


@unwound  # SIGINT, SIGTERM and SIGHUP unwind: nothing is left behind
def export(
    model: str | Path | ModelSource | Module,
    out_dir: str | Path,
    options: ExportOptions | None = None,
    *,
    tokenizer=None,
    progress: Callable[[str], None] = _no_progress,
    trace_cache: TraceCache | None = None,
    **fields,
) -> ExportResult:
    """Export ``model`` (see :func:`_load`) into ``out_dir`` with ``options`` (or its fields as
    keywords), ``tokenizer`` into its ``tokenizer/``; ``trace_cache``: an earlier trace."""
    out_dir, options = Path(out_dir), ExportOptions.of(options, fields)
    target = get_target(options.target)  # an unknown target is refused first
    check_target(out_dir)  # before any slow work
    if is_vision_language(model):  # image in, tokens out: its graphs (tfgraph/vision_export.py)
        return export_vision_language(export, model, out_dir, options, progress=progress)
    options, stages = options.resolved(target), Stages(progress)
    with stages.timed("load"):
        source = _load(model, options, tokenizer)
    budget = check_budget(source, options.view("quantizing"), out_dir)  # disk, memory: first
    with stages.timed("trace"):
        source, graph = trace_source(model, source, options.view("tracing"), trace_cache)
    shapes = parity_shapes(source, _within(options.parity_shapes, _positions(source)))
    with staged_directory(out_dir) as stage, contextlib.ExitStack() as cleanup:
        scratch = _Scratch(cleanup, out_dir.parent)
        steps = Steps(target, **asdict(options.view("checking")), dump_dir=stage)
        with stages.timed("passes"):
            steps.pipeline(graph, options.pipeline, options.pipeline_options(_positions(source)))
        graph, done = _rewrite(graph, source, options, shapes, steps, stages, scratch)
        encoder = split(graph, options.view("saving"), steps)
        # parity runs the artifact, or (paged) the shared-buffer graph that is then paged
        proof = scratch("paged") if options.kv_layout == "paged" else stage
        with stages.timed("save"):
            saved = write_artifact(graph, proof, source, options.view("saving"), steps, encoder)
        with stages.timed("parity"):
            parity = _parity(done, proof / saved.files[0], options, shapes)
        if proof != stage:
            with stages.timed("paging"):
                saved = _paged(graph, stage, source, options, steps, encoder, parity, done)
        if done.weights is not None:
            with stages.timed("quantization error"):
                done.weights["error_vs_fp32"] = weights_error(
                    source, done.reference, proof / saved.files[0], options.view("verifying"),
                    shapes,
                )  # fmt: skip
        report = _report(source, options, graph, saved, parity, done, budget, stages)
        _write_report(stage, out_dir, report, source, options, stages)
    return ExportResult(out_dir, saved.manifest, report)


class _Scratch:
    """``scratch(kind)``: a scratch directory beside the artifact, removed when the export ends."""

    def __init__(self, cleanup: contextlib.ExitStack, parent: Path) -> None:
        self.cleanup, self.parent = cleanup, parent

    def __call__(self, kind: str) -> Path:
        return self.cleanup.enter_context(scratch_directory(self.parent, kind))


def _rewrite(graph, source, options, shapes, steps, stages, scratch) -> tuple:
    """The steps after the pipeline that the options ask for: precision, weights, int8 KV."""
    done = Rewritten(reference=source)
    quantizing = options.view("quantizing")
    if options.precision != "fp32":
        with stages.timed("precision"):
            done.precision = convert_precision(graph, source, quantizing, shapes, steps)
    if options.weights is not None:
        with stages.timed("weights"):
            graph, done.weights, done.reference = quantize_weights(graph, source, quantizing, steps)
    if options.kv_dtype != "fp32":
        directory = scratch("kv")  # the reference's, beside the staging directory
        with stages.timed("kv cache"):
            done.kv_quantization, done.kv_reference = quantize_kv_cache(
                graph, source, quantizing, shapes, steps, directory
            )
    flavour = get_flavour(options.flavour)
    if flavour.name != "tfgraph":  # the runtime's own conventions, after every other rewrite
        with stages.timed("flavour"):
            flavour.rewrite(graph, source, options.view("flavouring"), steps)
    return graph, done


def _parity(done: Rewritten, model_file: Path, options: ExportOptions, shapes) -> dict:
    verifying = options.view("verifying")
    if done.kv_reference is not None:  # an int8 cache: the bound measured on its reference
        return check_int8_cache(done.reference, model_file, done.kv_reference, verifying, shapes)
    return check_artifact(done.reference, model_file, verifying, shapes)


def _paged(graph, stage: Path, source, options, steps, encoder, parity, done):
    """The artifact, paged when parity passed on its shared-buffer graph (else as it is, with
    the failing report), saved."""
    if parity["passed"]:
        page(graph, options.kv_block_size, steps)
    saved = write_artifact(graph, stage, source, options.view("saving"), steps, encoder)
    if parity["passed"]:
        done.paged = paged_report(graph, stage / saved.files[0], options.kv_block_size)
    return saved


def _load(model, options: ExportOptions, tokenizer=None) -> ModelSource:
    """The source of ``model``: a MODEL string or path (preset, ``package.module:function``,
    Hugging Face directory), a model object (an ``nn.Module``, ``(nn.Module, example_inputs)``,
    a transformers ``PreTrainedModel``: :mod:`tfgraph.sources.objects`) or a
    :class:`ModelSource` as it is; carrying ``tokenizer`` (saved into the artifact)."""
    if not isinstance(model, ModelSource):
        model = load_source(model, **asdict(options.view("loading")))
    get_flavour(options.flavour).check_source(model)  # a model it cannot describe: refused now
    model = with_tokenizer(model, tokenizer)
    if options.quality_text is not None:  # no tokenizer to measure with: refused now
        check_measurable(model, options.kv_layout)
    return model


def _positions(source: ModelSource) -> int | None:
    return source.info.get("max_positions")


def _write_report(stage: Path, out_dir: Path, report: dict, source, options, stages) -> None:
    """``report.json`` into the staged artifact; with ``quality_text`` (and parity passed) the
    artifact's quality over it measured there, against ``source`` (fp32), and added."""
    write_json(stage / "report.json", report)
    if options.quality_text is None:
        return
    if not report["parity"]["passed"]:
        logger.warning("quality: not measured, parity failed")
        return
    with stages.timed("quality"):
        quality = measure_quality(stage, options.quality_text, source=source)
    report["quality"] = {**quality, "artifact": str(out_dir)}  # where it is published
    write_json(stage / "report.json", report)


def _report(source, options, graph, saved, parity, done, budget, stages) -> dict:
    report = {
        "model": source.origin,
        "source": source.info,
        "parity": parity,
        "fusions": saved.fusions,
        "kv_cache": options.kv_cache,
        "flavour": options.flavour,
        "target": saved.manifest["target"],
        "opset": graph.opset_imports.get("", options.opset),
        "pipeline": options.pipeline,
        "precision": done.precision or {"precision": "fp32"},
        "weights": done.weights,
        "compatibility": options.target.compatibility(graph),  # e.g. TensorRT's parser
        "passes": saved.manifest["passes"],
        "timings": stages.timings,
        "kv_layout": options.kv_layout,
        "kv_dtype": options.kv_dtype,
        "budget": budget,
    }
    if done.paged is not None:
        report["paged"] = done.paged
    if done.kv_quantization is not None:
        report["kv_quantization"] = done.kv_quantization
    return report


def _within(shapes, max_positions: int | None):
    """Parity shapes inside the model's position limit (a model with 16 learned positions is
    checked at 16, not at the default 33)."""
    if not max_positions:
        return shapes
    return tuple((batch, min(seq, max_positions)) for batch, seq in shapes)
