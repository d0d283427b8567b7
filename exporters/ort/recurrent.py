"""The ``ort`` target's recurrent kernels: ONNX Runtime's ``com.microsoft.LinearAttention`` and
``CausalConvWithState`` (CPU kernels in ORT 1.32) take the canonical ``tfgraph.LinearAttention``
/ ``tfgraph.CausalConv`` inputs and outputs as they are. Handed to
:class:`~tfgraph.passes.lower.lower_recurrent.LowerRecurrentPass` as ``Target.lower_recurrent``."""

from __future__ import annotations

import onnx_ir as ir

from tfgraph.exporters.ort.ops import CAUSAL_CONV_WITH_STATE, LINEAR_ATTENTION, MS_DOMAIN
from tfgraph.passes.canonical import RECURRENT_OPS, CausalConvOp, LinearAttentionOp
from tfgraph.passes.lower.lower_recurrent import LoweredRecurrence

# canonical op → the contrib kernel that runs it
_CONTRIB = {LinearAttentionOp.OP: LINEAR_ATTENTION, CausalConvOp.OP: CAUSAL_CONV_WITH_STATE}


def contrib_kernel(tape: ir.tape.Tape, node: ir.Node) -> LoweredRecurrence:
    """ONNX Runtime's kernel for the canonical op: the same inputs and outputs."""
    spec = RECURRENT_OPS[node.op_type].read(node)
    if isinstance(spec, LinearAttentionOp):
        attrs = {
            "q_num_heads": spec.q_num_heads,
            "kv_num_heads": spec.kv_num_heads,
            "update_rule": spec.update_rule,
            "scale": spec.scale,
        }
    else:
        attrs = {"activation": spec.activation, "ndim": 1}
    op = _CONTRIB[node.op_type]
    outs = tape.op_multi_out(op, list(node.inputs), attrs, num_outputs=2, domain=MS_DOMAIN)
    return LoweredRecurrence((outs[0], outs[1]), op)
