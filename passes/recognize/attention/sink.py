"""Attention sinks: a learned logit per head in the softmax's denominator (gpt-oss, GPT-OSS-style
MoEs, Granite's sliding-window models), recognized as ``tfgraph.SinkSoftmax(s, sink)`` for the
core rules (:mod:`.rules`) to fuse into ``tfgraph.Attention(Q, K, V, bias, sink)``.

``SinkSoftmax(s, sink)`` over the last axis is ``p_j = exp(s_j) / (Σ_k exp(s_k) + exp(sink_h))``
with ``sink`` (H,) read along the head axis 1 of the (B, H, T, S) scores. Two exported forms:

- **concatenated column** (gpt-oss, DeepSeek-V4, Flint, Hunyuan-V4, MiMo-V2-Flash)::

      c = Concat(s, Expand(sinks(1, H, 1, 1), (B, H, T, 1)), axis=-1)
      p = Slice(Softmax([c − ReduceMax(c, -1)]), 0:-1 on the last axis)

  (subtracting the row max is a no-op for the softmax);
- **sigmoid scaling** (Granite SWA): ``MatMul(Softmax(s), V) · σ(logsumexp(s) − sinks)``, since
  ``σ(lse − sink) = Σ exp(s) / (Σ exp(s) + exp(sink))``: rewritten to
  ``MatMul(SinkSoftmax(s, sinks), V)``.

Rejections: a sink that is not one value per head (a per-token sink, Inkling 2's projection of
the hidden states, varies along the queries), a slice that does not drop exactly the last
column, reductions over another axis. A ``SinkSoftmax`` the core rules do not fuse is turned
back into standard ops (:func:`restore_sink_softmax`), so nothing unknown stays in the graph.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from tfgraph.passes.canonical import DOMAIN, SINK_SOFTMAX
from tfgraph.passes.rewrite_utils import insert_tape, int_list, replace_value


def _last_axis(axes: list[int] | None, rank: int) -> bool:
    return axes is not None and len(axes) == 1 and axes[0] in (-1, rank - 1)


def _per_head(sinks: ir.Value, scores: ir.Value) -> str | None:
    """Why ``sinks`` is not one value per head of ``scores`` (B, H, T, S); None when it is."""
    if scores.shape is None or len(scores.shape) != 4 or not isinstance(scores.shape[1], int):
        return "the scores are not 4-D (B, heads, T, S) with static heads"
    heads = scores.shape[1]
    shape = sinks.shape
    if shape is None:
        return "the sink's shape is unknown"
    if any(not isinstance(d, int) for d in shape):
        return f"the sink {list(shape)} varies along batch or queries: per-token sinks"
    dims = list(shape)
    while len(dims) < 4:
        dims.insert(0, 1)
    if len(dims) != 4 or dims != [1, heads, 1, 1]:
        return f"the sink {list(shape)} is not one value per head ({heads}): per-token sinks"
    return None


def _sink_vector(op, sinks: ir.Value) -> ir.Value:
    return op.Reshape(sinks, op.Constant(value=ir.tensor(np.array([-1], dtype=np.int64))))


class ConcatSinkRule(pattern.RewriteRuleClassBase):
    """``Slice(Softmax([c − max c]), …, :-1)`` with ``c = Concat(s, Expand(sinks, …))``."""

    def __init__(self, max_shift: bool) -> None:
        super().__init__(f"ConcatSink{'MaxShift' if max_shift else ''}")
        self._max_shift = max_shift

    def pattern(self, op, s, column, axes_max, starts, ends, axes):
        # The sink column is an input of the match, not part of it: layers whose sinks are
        # equal share one Expand after CSE (deduplicated initializers), and a matched node
        # used by another layer's Concat would block every layer's rewrite.
        c = op.Concat(s, column, _outputs=["combined"])
        if self._max_shift:
            c = op.Sub(c, op.ReduceMax(c, axes_max, _outputs=["row_max"]))
        probs = op.Softmax(c, _outputs=["probs"])
        return op.Slice(probs, starts, ends, axes, _allow_other_inputs=True, _outputs=["kept"])

    def check(self, context, s, column, combined, probs, starts, ends, axes, kept, **kw):
        result = pattern.MatchResult()
        sinks = _unexpanded(column)
        rank = 4
        if combined.producer().attributes.get_int("axis") not in (-1, rank - 1):
            return result.fail("the sink is not concatenated along the key axis", combined)
        if probs.producer().attributes.get_int("axis", -1) not in (-1, rank - 1):
            return result.fail("softmax is not over the key axis", probs)
        if self._max_shift:
            node = kw["row_max"].producer()
            if not _last_axis(int_list(kw["axes_max"]), rank):
                return result.fail("the row max is not over the key axis", kw["row_max"])
            if node.attributes.get_int("keepdims", 1) != 1:
                return result.fail("the row max does not keep its axis", kw["row_max"])
        if int_list(starts) != [0] or int_list(ends) != [-1] or not _last_axis(int_list(axes), 4):
            return result.fail("the slice does not drop exactly the sink column", probs)
        steps = kept.producer().inputs[4:]
        if steps and steps[0] is not None and int_list(steps[0]) != [1]:
            return result.fail("the slice has a step", probs)
        reason = _per_head(sinks, s)
        if reason:
            return result.fail(reason, sinks)
        return result

    def rewrite(self, op, s, column, **_):
        return op.SinkSoftmax(s, _sink_vector(op, _unexpanded(column)), axis=-1, _domain=DOMAIN)


def _unexpanded(column: ir.Value) -> ir.Value:
    """The sink a concatenated column is expanded from; the column itself when it is not
    expanded (then a per-token sink, which :func:`_per_head` refuses)."""
    node = column.producer()
    return node.inputs[0] if node is not None and node.op_type == "Expand" else column


class SigmoidSinkRule(pattern.RewriteRuleClassBase):
    """``MatMul(Softmax(s), V) · Unsqueeze(σ(ReduceLogSumExp(s) − sinks), -1)`` (Granite SWA),
    with or without Casts around the sigmoid."""

    def __init__(self, cast: bool) -> None:
        super().__init__(f"SigmoidSink{'Cast' if cast else ''}")
        self._cast = cast

    def pattern(self, op, s, v, axes_lse, sinks, axes_u):
        y = op.MatMul(op.Softmax(s, _outputs=["probs"]), v)
        lse = op.ReduceLogSumExp(s, axes_lse, _outputs=["lse"])
        gate = op.Sub(lse, sinks)
        if self._cast:
            gate = op.Cast(gate)
        gate = op.Sigmoid(gate)
        if self._cast:
            gate = op.Cast(gate)
        return op.Mul(y, op.Unsqueeze(gate, axes_u))

    def check(self, context, s, sinks, probs, lse, axes_lse, axes_u, **_):
        result = pattern.MatchResult()
        if probs.producer().attributes.get_int("axis", -1) not in (-1, 3):
            return result.fail("softmax is not over the key axis", probs)
        if not _last_axis(int_list(axes_lse), 4):
            return result.fail("logsumexp is not over the key axis", lse)
        if lse.producer().attributes.get_int("keepdims", 1) != 0:
            return result.fail("logsumexp keeps its axis", lse)
        if not _last_axis(int_list(axes_u), 4):
            return result.fail("the gate is not unsqueezed on the last axis", lse)
        # sinks (1, H, 1) against lse (B, H, T): one value per head
        heads = s.shape[1] if s.shape is not None and len(s.shape) == 4 else None
        shape = sinks.shape
        dims = list(shape) if shape is not None else None
        if dims is not None and all(isinstance(d, int) for d in dims):
            dims = [1] * (3 - len(dims)) + dims
        if not isinstance(heads, int) or dims != [1, heads, 1]:
            return result.fail(f"the sink {dims} is not one value per head", sinks)
        return result

    def rewrite(self, op, s, v, sinks, **_):
        probs = op.SinkSoftmax(s, _sink_vector(op, sinks), axis=-1, _domain=DOMAIN)
        return op.MatMul(probs, v)


SINK_RULES = [
    ConcatSinkRule.rule(True),
    ConcatSinkRule.rule(False),
    SigmoidSinkRule.rule(False),
    SigmoidSinkRule.rule(True),
]


def is_sink_softmax(node: ir.Node) -> bool:
    return node.domain == DOMAIN and node.op_type == SINK_SOFTMAX


def sink_column(tape: ir.tape.Tape, scores: ir.Value, sink: ir.Value, ints) -> ir.Value:
    """``sink`` (H,) as the (B, H, T, 1) column beside ``scores`` (B, H, T, S)."""
    column = tape.op("Reshape", [sink, ints("sink_shape", [1, -1, 1, 1])])
    shape = tape.op(
        "Concat",
        [
            tape.op("Shape", [scores], {"start": 0, "end": 3}),
            ints("one1", [1]),
        ],
        {"axis": 0},
    )
    return tape.op("Expand", [column, shape])


def sink_softmax_ops(tape: ir.tape.Tape, scores: ir.Value, sink: ir.Value, ints) -> ir.Value:
    """Standard ops for ``SinkSoftmax``: Softmax over the scores with the sink column, which is
    then dropped. ``ints(name, values)`` makes an int64 constant."""
    combined = tape.op("Concat", [scores, sink_column(tape, scores, sink, ints)], {"axis": -1})
    probs = tape.op("Softmax", [combined], {"axis": -1})
    return tape.op("Slice", [probs, ints("zero1", [0]), ints("minus1", [-1]), ints("minus1", [-1])])


def restore_sink_softmax(model: ir.Model, node: ir.Node) -> ir.Node:
    """Replace a ``SinkSoftmax`` left unfused by its standard ops; returns their Softmax."""
    tape = ir.tape.Tape()
    consts: dict[str, ir.Value] = {}

    def ints(name, values):
        if name not in consts:
            consts[name] = tape.op(
                "Constant", [], {"value": ir.tensor(np.asarray(values, dtype=np.int64))}
            )
        return consts[name]

    scores, sink = node.inputs[0], node.inputs[1]
    out = sink_softmax_ops(tape, scores, sink, ints)
    out.shape, out.type = node.outputs[0].shape, node.outputs[0].type
    for new in tape.nodes:
        new.metadata_props.update(node.metadata_props)
    insert_tape(model.graph, node, tape)
    replace_value(node.outputs[0], out)
    model.graph.remove(node, safe=True)
    return next(n for n in tape.nodes if n.op_type == "Softmax")
