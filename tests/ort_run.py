"""The tests' one way to run a graph in ONNX Runtime on the CPU: :func:`ort_session` opens it,
:func:`run_onnx` runs it once.

Tests that check what a graph computes (a rewrite against the graph before it, a lowering against
numpy, a kernel against our reading of its format) run it here; ``optimize=False`` turns ONNX
Runtime's graph optimizations off, so that the graph runs as written rather than as ONNX Runtime
would fuse it. Tests of ONNX Runtime's own behaviour (its optimizer, what it refuses at load) and
tests that show what a plain consumer of an artifact writes open their own ``InferenceSession``
and say why. Artifacts as tfgraph runs them go through ``tfgraph.runtime.Session``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

Model = ir.Model | onnx.ModelProto | bytes | str | Path


def _loadable(model: Model) -> bytes | str:
    """What ``InferenceSession`` takes: serialized bytes, or a file's path (its external data
    read beside it)."""
    if isinstance(model, ir.Model):
        return ir.to_proto(model).SerializeToString()
    if isinstance(model, onnx.ModelProto):
        return model.SerializeToString()
    if isinstance(model, Path):
        return str(model)
    return model


def ort_session(
    model: Model, *, optimize: bool = True, log_severity: int | None = None
) -> ort.InferenceSession:
    """A CPU session for ``model`` (an IR model, a ModelProto, its bytes or a file's path);
    ``optimize=False``: no graph optimizations; ``log_severity``: ONNX Runtime's log level."""
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if log_severity is not None:
        options.log_severity_level = log_severity
    return ort.InferenceSession(_loadable(model), options, providers=["CPUExecutionProvider"])


def run_onnx(
    model: Model,
    feeds: Mapping[str, np.ndarray] | np.ndarray,
    *,
    outputs: Sequence[str] | None = None,
    optimize: bool = True,
    log_severity: int | None = None,
) -> list[np.ndarray]:
    """``model``'s outputs (all, or those named in ``outputs``) on ``feeds``: arrays by input
    name, or one array for the graph's first input."""
    session = ort_session(model, optimize=optimize, log_severity=log_severity)
    if not isinstance(feeds, Mapping):
        feeds = {session.get_inputs()[0].name: feeds}
    return session.run(None if outputs is None else list(outputs), dict(feeds))
