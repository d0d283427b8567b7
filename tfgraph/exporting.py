"""``export``: source → trace → pipeline → ONNX → parity, written as one atomic artifact.

An artifact directory holds ``model.onnx`` (plus ``model.onnx.data`` past 2 GB),
``manifest.json`` and ``report.json``. It is staged beside the target and renamed into place
only when complete; a failure at any step leaves no output directory behind. A model whose
parity fails is still written (its report says why), and :attr:`ExportResult.passed` is False.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import sysconfig
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tfgraph.contract import ENCODER_FILE
from tfgraph.exporters import check_target, save_onnx, staged_directory, write_json
from tfgraph.passes.split_encoder import split_encoder
from tfgraph.targets import Target, get_target

from .cache_parity import check_cache_parity
from .errors import TfgraphError
from .fusions import count_fusions
from .manifest import build_manifest
from .parity import FP32, PARITY_SHAPES, Tolerance, check_parity
from .pipeline import PassRecord, check_model, run_pipeline
from .precision import apply_precision, check_precision
from .sources import ModelSource, load_source
from .trace import TraceCache, trace
from .weights import (
    DEFAULT_BLOCK_SIZE,
    check_weights,
    dequantized_source,
    quantization_error,
    quantize,
)

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


def export(
    model: str | ModelSource,
    out_dir: str | Path,
    *,
    pipeline: str = "default",
    profile: str | Target = "ort",
    opset: int | None = None,
    check_each_pass: bool = False,
    external_data: bool | None = None,
    parity_shapes=PARITY_SHAPES,
    tolerance: Tolerance = FP32,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    dump_after: str | None = None,
    kv_cache: bool = False,
    progress: Callable[[str], None] = _no_progress,
    target: str | Target | None = None,
    trace_cache: TraceCache | None = None,
    precision: str = "fp32",
    keep_io_types: bool = False,
    weights: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    symmetric: bool = False,
    quantize_lm_head: bool = True,
    accuracy_level: int | None = None,
) -> ExportResult:
    """Export ``model`` (a MODEL string as the CLI takes it, or a :class:`ModelSource`) for
    target ``profile`` (a :class:`tfgraph.targets.Target` or a registered name such as
    ``ort``, ``onnx``, ``tensorrt@10.14``); ``target`` is the same, and wins when given.
    ``trace_cache`` reuses an earlier export's trace of the same source and opset.
    ``precision`` (``fp16``, ``bf16``): the graph's floats in that type outside the fp32
    islands measured on the parity inputs (:mod:`tfgraph.precision`), fp32 inputs and outputs
    with ``keep_io_types``; parity then follows the precision's rule. ``weights`` (``int8``,
    ``int4``): MatMul weights block-wise in ``MatMulNBits`` (:mod:`tfgraph.weights`); parity
    then runs against eager PyTorch with the same dequantized weights; ``accuracy_level``
    (MatMulNBits': 4 quantizes activations per block, 0 keeps them fp32; ``None``, the
    target's default) with the reference quantizing activations the same way."""
    out_dir = Path(out_dir)
    target = get_target(target if target is not None else profile)
    check_target(out_dir)  # before any slow work
    check_precision(precision, keep_io_types, target)
    accuracy_level = check_weights(weights, block_size, target, accuracy_level)
    if opset is None:
        opset = target.opset
    check_opset(opset)
    timings: dict[str, float] = {}

    def step(name: str, fn, *args, **kwargs):
        progress(name)
        start = time.perf_counter()
        value = fn(*args, **kwargs)
        timings[name] = round(time.perf_counter() - start, 3)
        logger.info("%s: %.2f s", name, timings[name])
        return value

    if isinstance(model, ModelSource):
        source = model
    else:
        source = step(
            "load",
            load_source,
            model,
            trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation,
        )

    def traced(source: ModelSource):
        if trace_cache is None:
            return _trace(source, opset)
        return trace_cache.get(source, opset, _trace)

    try:
        graph = step("trace", traced, source)
    except TfgraphError:
        # Some Hugging Face attention back-ends do not trace with dynamic shapes (T5 with sdpa
        # in transformers 5); the eager implementation computes the same function. Retry with
        # it, unless the user chose the implementation.
        if attn_implementation or source.info.get("attn_implementation") in (None, "eager"):
            raise
        logger.warning(
            "tracing with attn_implementation=%s failed; retrying with eager attention",
            source.info["attn_implementation"],
        )
        source = load_source(
            model, trust_remote_code=trust_remote_code, attn_implementation="eager"
        )
        source.info["attn_fallback"] = "eager"
        graph = step("trace", traced, source)
    with staged_directory(out_dir) as stage:
        records = step(
            "passes",
            run_pipeline,
            graph,
            pipeline,
            profile=target,
            check_each_pass=check_each_pass,
            dump_after=dump_after,
            dump_dir=stage,
            kv_cache=kv_cache,
            max_positions=source.info.get("max_positions"),
        )
        parity_shapes = _within(parity_shapes, source.info.get("max_positions"))
        precision_report = None
        if precision != "fp32":
            precision_report = step(
                "precision",
                apply_precision,
                graph,
                source,
                precision,
                keep_io_types=keep_io_types,
                shapes=parity_shapes,
            )
            check_model(graph, "ConvertPrecisionPass", target)
            records.append(PassRecord("ConvertPrecisionPass", timings["precision"], True))
        weights_report = None
        reference = source
        if weights is not None:
            graph, weights_report = step(
                "weights",
                quantize,
                graph,
                weights,
                block_size=block_size,
                symmetric=symmetric,
                lm_head=quantize_lm_head,
                accuracy_level=accuracy_level,
            )
            check_model(graph, "MatMulNBitsQuantizer", target)
            records.append(PassRecord("MatMulNBitsQuantizer", timings["weights"], True))
            reference, placed = dequantized_source(
                source, weights_report.pop("_dequantized"), graph
            )
            weights_report["parameters"] = placed
        fusions = count_fusions(graph, pipeline, target=target)
        files = []
        encoder = None
        if kv_cache:
            encoder = split_encoder(graph)  # encoder-decoder: the encoder runs once per prompt
            if encoder is not None:
                check_model(encoder, "split_encoder", target)
                check_model(graph, "split_encoder", target)
                files += save_onnx(encoder, stage, external_data=external_data, name=ENCODER_FILE)
        files = step("save", save_onnx, graph, stage, external_data=external_data) + files
        files += _copy_tokenizer(source, stage)
        passes = [r.as_dict() for r in records]
        manifest = build_manifest(
            graph,
            kv_cache=kv_cache,
            origin=source.origin,
            pipeline=pipeline,
            target=target,
            passes=passes,
            fusions=fusions,
            files=files,
            max_positions=source.info.get("max_positions"),
            encoder=encoder,
        )
        manifest["precision"] = precision
        manifest["target"]["runner"] = target.runner_for(precision)
        write_json(stage / "manifest.json", manifest)  # the runner reads it
        parity = step(
            "parity",
            check_cache_parity if kv_cache else check_parity,
            reference,
            stage / files[0],
            shapes=parity_shapes,
            tolerance=tolerance,
            precision=precision,
        )
        report = {
            "model": source.origin,
            "source": source.info,
            "parity": parity,
            "fusions": fusions,
            "kv_cache": kv_cache,
            "profile": target.label,
            "target": manifest["target"],
            "opset": graph.opset_imports.get("", opset),
            "pipeline": pipeline,
            "precision": precision_report or {"precision": "fp32"},
            "weights": weights_report,
            "compatibility": target.compatibility(graph),  # e.g. TensorRT's parser, statically
            "passes": passes,
            "timings": timings,
        }
        if weights_report is not None:
            weights_report["error_vs_fp32"] = step(
                "quantization error",
                quantization_error,
                source,
                reference,
                stage / files[0] if kv_cache else None,
                parity_shapes,
            )
        write_json(stage / "report.json", report)
    return ExportResult(out_dir, manifest, report)


def _within(shapes, max_positions: int | None):
    """Parity shapes inside the model's position limit (a model with 16 learned positions is
    checked at 16, not at the default 33)."""
    if not max_positions:
        return shapes
    return tuple((batch, min(seq, max_positions)) for batch, seq in shapes)


MIN_OPSET = 18  # torch.onnx's dynamo exporter emits nothing older


def check_opset(opset: int) -> None:
    """Refuse an opset the exporter cannot write (instead of a silent conversion)."""
    import onnx

    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise TfgraphError(
            f"--opset {opset} is not supported: choose {MIN_OPSET} to {newest} "
            f"(torch.onnx's exporter starts at {MIN_OPSET}; this onnx knows up to {newest})"
        )


def _trace(source: ModelSource, opset: int):
    """:func:`trace`, quiet on failure (torch.export prints partial graphs on stderr: they go to
    the debug log); data-dependent control flow is named with the line that branches."""
    try:
        with _torch_output_to_log():
            return trace(source, opset=opset)
    except TfgraphError as exc:
        site = _data_dependent_site(exc)
        if site is None:
            raise
        guard = _root(exc)
        what = f"{type(guard).__name__}: {str(guard).split(' (unhinted')[0].splitlines()[0]}"
        raise TfgraphError(
            f"tracing {source.origin} failed: the model branches on tensor values at {site}, "
            f"which torch.export cannot trace ({what}); make the branch depend on shapes only, "
            "or write it with torch.cond"
        ) from exc


@contextlib.contextmanager
def _torch_output_to_log():
    torch_logger = logging.getLogger("torch")
    level = torch_logger.level
    torch_logger.setLevel(logging.ERROR)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    finally:
        torch_logger.setLevel(level)
        if captured.getvalue().strip():
            logger.debug("torch wrote while tracing:\n%s", captured.getvalue())


def _root(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _data_dependent_site(exc: BaseException) -> str | None:
    """``file:line: code`` of the innermost frame outside torch and the standard library, when
    the root cause is a guard on a data-dependent expression."""
    exc = _root(exc)
    if "data-dependent" not in str(exc):
        return None
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.line]
    user = [f for f in frames if not _library_file(f.filename)]
    if not user:
        return None
    frame = user[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} (`{frame.line.strip()}`)"


def _library_file(filename: str) -> bool:
    """torch itself, or the standard library (not packages installed beside it)."""
    if filename.startswith(os.path.dirname(torch.__file__)):
        return True
    installed = ("site-packages", "dist-packages")
    stdlib = sysconfig.get_paths()["stdlib"]
    return filename.startswith(stdlib) and not any(d in filename for d in installed)


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


def _copy_tokenizer(source: ModelSource, stage: Path) -> list[str]:
    """A Hugging Face directory's tokenizer files go into ``tokenizer/`` (for ``generate
    --text``); their contents are data, never code."""
    if not source.origin.startswith("hf:"):
        return []
    origin = Path(source.origin[3:])
    found = [origin / n for n in TOKENIZER_FILES if (origin / n).is_file()]
    if not found:
        return []
    (stage / "tokenizer").mkdir()
    for path in found:
        shutil.copyfile(path, stage / "tokenizer" / path.name)
    return [f"tokenizer/{p.name}" for p in found]
