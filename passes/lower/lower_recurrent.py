"""``LowerRecurrentPass``: every ``tfgraph.LinearAttention`` / ``tfgraph.CausalConv`` becomes
what its target chooses (``Target.lower_recurrent``):

- a kernel the target builds itself (``ort``: ONNX Runtime's ``com.microsoft.LinearAttention``
  / ``CausalConvWithState``, which take the canonical ops' inputs as they are:
  ``tfgraph.exporters.ort.recurrent``), returned as a :class:`LoweredRecurrence`;
- standard ops (:mod:`.recurrent_standard`): a ``Scan`` over the tokens for the recurrence,
  ``Concat`` + ``Conv`` + ``Slice`` for the convolution, reported as missed with the target's
  reason (targets without such kernels: ``onnx``, ``tensorrt``).

Either way the two outputs (y, present_state) keep their names and roles: a cached graph's
``present_state`` output (:mod:`.insert_recurrent_state`) is the lowered op's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import onnx_ir as ir

from tfgraph.passes.canonical import RECURRENT_OPS, CausalConvOp, is_canonical
from tfgraph.passes.rewrite_utils import (
    LOWERED_FROM_KEY,
    import_used_domains,
    insert_tape,
    mark_missed,
    replace_value,
)
from tfgraph.passes.target_arg import require_target

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoweredRecurrence:
    """(y, present_state) of a lowered recurrent op, the op it became, and why it is not a
    kernel (``None``: a fused kernel)."""

    outputs: tuple[ir.Value, ir.Value]
    op: str
    missed: str | None = None


def standard_ops(tape: ir.tape.Tape, node: ir.Node, reason: str) -> LoweredRecurrence:
    """The canonical op in standard ONNX ops (:mod:`.recurrent_standard`), missed for
    ``reason``."""
    from tfgraph.passes.lower.recurrent_standard import (
        standard_causal_conv,
        standard_linear_attention,
    )

    spec = RECURRENT_OPS[node.op_type].read(node)
    if isinstance(spec, CausalConvOp):
        y, state = standard_causal_conv(tape, node, spec)
        op = "Conv"
    else:
        y, state = standard_linear_attention(tape, node, spec)
        op = "Scan"
    first = next(n for n in tape.nodes if n.op_type == op)
    mark_missed(first, reason)
    return LoweredRecurrence((y, state), op, reason)


class LowerRecurrentPass(ir.passes.InPlacePass):
    """Replace every canonical recurrent op by its target's choice (module docstring)."""

    def __init__(self, target) -> None:
        super().__init__()
        self.target = require_target(target)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        count = 0
        for node in list(graph):
            if not (is_canonical(node) and node.op_type in RECURRENT_OPS):
                continue
            tape = ir.tape.Tape()
            lowered = self.target.lower_recurrent(tape, node)
            insert_tape(graph, node, tape)
            for new in tape.nodes:
                new.metadata_props[LOWERED_FROM_KEY] = node.op_type
            for old, new in zip(node.outputs, lowered.outputs, strict=True):
                new.shape, new.type = old.shape, old.type
                replace_value(old, new)
            graph.remove(node, safe=True)
            logger.debug("lowered %s to %s", node.name, lowered.op)
            count += 1
        if count:
            import_used_domains(model)
        return ir.passes.PassResult(model, modified=bool(count))
