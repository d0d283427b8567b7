"""Tracing: ``nn.Module`` → torch.export → torch.onnx dynamo exporter → ``onnx_ir.Model``.

Batch and sequence dimensions stay dynamic and keep their names (``batch``, ``sequence``, ...).
The exporter's node metadata (``pkg.torch.onnx.name_scopes``: the PyTorch module path of every
node) is kept, so reports can map graph nodes back to modules (:func:`module_name`).
"""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import warnings

import onnx_ir as ir
import torch

from .errors import TfgraphError
from .sources import ModelSource

logger = logging.getLogger(__name__)

DEFAULT_OPSET = 20
EXAMPLE_SHAPE = (2, 9)  # batch, sequence: ≥ 2 so torch.export does not specialize them


def trace(source: ModelSource, *, opset: int = DEFAULT_OPSET) -> ir.Model:
    """Export the source's module to an ``onnx_ir.Model`` with named dynamic axes."""
    inputs = source.inputs(*EXAMPLE_SHAPE)
    args = tuple(inputs[n] for n in source.input_names)
    dynamic = tuple(source.dynamic_axes.get(n, {}) for n in source.input_names)
    logger.info("tracing %s (opset %d)", source.origin, opset)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                source.module,
                args,
                dynamo=True,
                dynamic_shapes=dynamic,
                input_names=list(source.input_names),
                output_names=list(source.output_names),
                opset_version=opset,
                optimize=True,
                verbose=False,
                report=False,
            )
    except Exception as exc:
        raise TfgraphError(f"tracing {source.origin} failed: {_first_line(exc)}") from exc
    model = program.model
    model.producer_name = "tfgraph"
    return model


def _first_line(exc: BaseException) -> str:
    while exc.__cause__ is not None:  # the exporter wraps the real error; name that one
        exc = exc.__cause__
    text = str(exc).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("Traceback", "File ", "For more information")):
            return f"{type(exc).__name__}: {line}"
    return type(exc).__name__


def module_name(node: ir.Node) -> str:
    """The PyTorch module path a node was traced from (``blocks.0.attn``), or ``""``."""
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if not scopes:
        return ""
    try:
        names = ast.literal_eval(scopes)
    except (ValueError, SyntaxError):
        return ""
    # Each scope is already the full module path; the last one is the op itself.
    return names[-2] if len(names) >= 2 else ""
