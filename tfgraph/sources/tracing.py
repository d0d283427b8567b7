"""The trace stage of ``export``: :func:`trace` made quiet (torch.export's partial graphs go to
the debug log), the static axes asked for fixed first (:mod:`tfgraph.sources.static_axes`),
data-dependent branches named with the line that branches, an axis the model's code fixes
explained with the flag that exports it static (:mod:`tfgraph.sources.axis_conflicts`), a
Hugging Face model retried with eager attention when its attention back-end does not trace,
traces reused through a :class:`TraceCache`."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import sysconfig
import traceback
from pathlib import Path

import onnx_ir as ir
import torch

from tfgraph.errors import TfgraphError
from tfgraph.sources import axis_conflicts
from tfgraph.sources.loading import load_source
from tfgraph.sources.model import ModelSource
from tfgraph.sources.static_axes import with_static_axes
from tfgraph.sources.trace import TraceCache, export_program, trace

logger = logging.getLogger(__name__)


def trace_source(
    model, source: ModelSource, options, trace_cache: TraceCache | None = None
) -> tuple[ModelSource, ir.Model]:
    """(the source that traced, its graph at ``options.opset``). Some Hugging Face attention
    back-ends do not trace with dynamic shapes (T5 with sdpa in transformers 5); the eager
    implementation computes the same function: ``model`` (the MODEL string, or the model
    object) is reloaded with it, unless the user chose the implementation."""

    static = getattr(options, "static_axes", ())
    kv_cache = getattr(options, "kv_cache", False)
    trace_fn = functools.partial(_trace, kv_cache=kv_cache)

    def traced(source: ModelSource) -> ir.Model:
        if trace_cache is None:
            return trace_fn(source, options.opset)
        return trace_cache.get(source, options.opset, trace_fn)

    source = with_static_axes(source, static, kv_cache=kv_cache)
    try:
        return source, traced(source)
    except TfgraphError:
        implementation = source.info.get("attn_implementation")
        if options.attn_implementation or implementation in (None, "eager"):
            raise
        if isinstance(model, ModelSource):  # a source made by the caller: nothing to reload
            raise
        logger.warning(
            "tracing with attn_implementation=%s failed; retrying with eager attention",
            implementation,
        )
        reloaded = load_source(
            model, trust_remote_code=options.trust_remote_code, attn_implementation="eager"
        )
        reloaded = with_static_axes(reloaded, static, kv_cache=kv_cache)
        reloaded.info["attn_fallback"] = "eager"
        reloaded.tokenizer = source.tokenizer  # the one given with the model, if any
        return reloaded, traced(reloaded)


def _trace(source: ModelSource, opset: int, kv_cache: bool = False):
    """:func:`trace`, quiet on failure (torch.export prints partial graphs on stderr: they go to
    the debug log); data-dependent control flow is named with the line that branches, an axis
    the model's code fixes with the line that fixes it and the flag to export it static."""
    try:
        with _torch_output_to_log():
            return trace(source, opset=opset)
    except TfgraphError as exc:
        if axis_conflicts.is_conflict(exc):
            retrace = functools.partial(export_program, source)  # torch.export alone
            with _torch_output_to_log():
                explained = axis_conflicts.explained(source, exc, retrace, kv_cache)
            if explained is not None:
                raise explained from exc
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
    """torch itself, the standard library (not packages installed beside it), or tfgraph's own
    trace-time wrappers here (a torch function mode sits between the model and torch)."""
    if filename.startswith((os.path.dirname(torch.__file__), os.path.dirname(__file__))):
        return True
    installed = ("site-packages", "dist-packages")
    stdlib = sysconfig.get_paths()["stdlib"]
    return filename.startswith(stdlib) and not any(d in filename for d in installed)
