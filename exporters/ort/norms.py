"""The ``ort`` targets' norm kernels, built on a :class:`~tfgraph.passes.lower.lower_norms.NormCase`
(the targets' ``lower_norm`` picks among them and the case's standard ones):

- :func:`simplified`: ``SimplifiedLayerNormalization`` (ONNX Runtime's RMSNorm kernel,
  registered in the default domain although ONNX has no such op);
- :func:`skip`: ``com.microsoft.SkipLayerNormalization`` / ``SkipSimplifiedLayerNormalization``
  with the residual ``Add`` (``None`` when there is none)::

    a ─┐                            a ─┐
       Add ─► s ─► Norm ─► y   ⇒       SkipNorm ─► y
    b ─┘      └──► (other uses)     b ─┘   └─────► s  (output 3: a + b)

  It applies when ``a`` and ``b`` have the same rank-2 or rank-3 shape (what ORT's kernels
  accept) and the sum is not a graph output.
"""

from __future__ import annotations

import onnx_ir as ir

from tfgraph.exporters.ort.ops import (
    MS_DOMAIN,
    SIMPLIFIED_LAYER_NORM,
    SKIP_LAYER_NORM,
    SKIP_SIMPLIFIED_LAYER_NORM,
)
from tfgraph.passes.lower.lower_attention import Lowered
from tfgraph.passes.lower.lower_norms import NormCase


def simplified(case: NormCase) -> Lowered:
    """``SimplifiedLayerNormalization`` (RMSNorm) in the default domain."""
    attrs = {"axis": -1, "epsilon": case.epsilon, "stash_type": 1}
    y = case.tape.op(SIMPLIFIED_LAYER_NORM, [case.x, case.scale], attrs)
    return Lowered(y, SIMPLIFIED_LAYER_NORM)


def skip(case: NormCase) -> Lowered | None:
    """The skip (residual) kernel, when the norm's input is such an ``Add``."""
    add = _residual_add(case.x)
    if add is None:
        return None
    ones = case.scale.producer()
    if ones is not None and any(v is case.x for n in (ones, *_producers(ones)) for v in n.inputs):
        return None  # ones read off the sum's shape: the fused sum would feed itself
    a, b = add.inputs
    inputs = [a, b, case.scale] + ([case.bias] if case.bias is not None else [])
    op = SKIP_SIMPLIFIED_LAYER_NORM if case.rms else SKIP_LAYER_NORM
    new = case.tape.op_multi_out(
        op, inputs, {"epsilon": case.epsilon}, num_outputs=4, domain=MS_DOMAIN
    )
    case.absorb_add(add, new[3])
    return Lowered(new[0], op)


def _producers(node: ir.Node) -> list[ir.Node]:
    return [v.producer() for v in node.inputs if v is not None and v.producer() is not None]


def _residual_add(x: ir.Value) -> ir.Node | None:
    add = x.producer()
    if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
        return None
    a, b = add.inputs
    if a is None or b is None or a.shape is None or b.shape is None:
        return None
    if len(a.shape) not in (2, 3) or list(a.shape) != list(b.shape):
        return None
    if add.outputs[0].is_graph_output():
        return None
    return add
