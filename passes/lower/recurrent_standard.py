"""Standard-ONNX lowerings of the recurrent canonical ops, for targets without ONNX Runtime's
contrib kernels: opset 23, and only ops TensorRT's parser takes (``Scan``, ``Conv``, ``Concat``,
``Slice``, ``MatMul``, ``Reshape``, ``Transpose``, elementwise). One graph serves prefill
(T > 1) and decode (T = 1): B and T stay symbolic, heads come from the attributes.

- :func:`standard_linear_attention`: ``tfgraph.LinearAttention`` as one ``Scan`` over the
  tokens, in float32 whatever the inputs' type (cast in and back)::

      q (B, T, Hq·dk) ─ Reshape (B, T, H, G, dk) ─ Mul(scale) ─┐
      k (B, T, H·dk) ─ Reshape (B, T, H, dk, 1) ───────────────┤ scan inputs,
      v (B, T, H·dv) ─ Reshape (B, T, H, 1, dv) ───────────────┤ axis 1
      decay g ─ Reshape (B, T, H, dk or 1, 1) ─ Exp ───────────┤ (gated rules)
      beta ─ Reshape (B, T, H or 1, 1, 1) ─────────────────────┤ (delta rules)
      past_state, or zeros (B, H, dk, dv) ─────────────────────┴► Scan ─► present_state
                                                                   └► (B, T, H, G, dv)
                                                                      ─ Reshape ─► y

  The body takes one token (scan axis removed) and the state S (B, H, dk, dv)::

      S ← a·S                      a = e^g: gated, gated_delta
      S ← S + k ⊗ v                linear, gated                 (k ⊗ v = MatMul(k, v))
      S ← S + k ⊗ β·(v − kᵀS)      delta, gated_delta (S already decayed)
      y = (scale·q) S              (B, H, G, dv): G = Hq / H query heads per state

  ``scale`` 0 means 1/√dk, as in ONNX Runtime's op. Grouped heads (Hq a multiple of H) share
  a state: query head h reads state h // G, as ONNX Runtime's op does.
- :func:`standard_causal_conv`: ``tfgraph.CausalConv`` as a depthwise ``Conv`` over the past
  columns and the new ones::

      past_state or zeros (B, C, K−1) ─┐
      x (B, C, T) ─────────────────────┴► Concat(axis 2) ─► Conv(group C) ─► [x·Sigmoid(x)] ─► y
                                                └► Slice(−(K−1):) ─► present_state

The builders put nodes and initializers (named after the canonical node) on the given tape; the
caller inserts the tape and points the canonical node's outputs at the returned values.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from tfgraph.passes.canonical import CausalConvOp, LinearAttentionOp

logger = logging.getLogger(__name__)

FLOAT = ir.DataType.FLOAT
_INT64_MAX = np.iinfo(np.int64).max


class _Consts:
    """Initializers on ``tape`` named after the canonical node, unique in its graph."""

    def __init__(self, tape: ir.tape.Tape, node: ir.Node) -> None:
        self.tape = tape
        self.prefix = _prefix(node)
        self.taken = set(node.graph.initializers) if node.graph is not None else set()

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        taken = self.taken | {v.name for v in self.tape.initializers}
        unique, i = f"{self.prefix}_{name}", 0
        while unique in taken:
            i += 1
            unique = f"{self.prefix}_{name}_{i}"
        return self.tape.initializer(ir.tensor(array), name=unique)

    def ints(self, name: str, values) -> ir.Value:
        return self.const(name, np.asarray(values, dtype=np.int64))


def standard_linear_attention(
    tape: ir.tape.Tape, node: ir.Node, spec: LinearAttentionOp
) -> tuple[ir.Value, ir.Value]:
    """(y, present_state) of a ``tfgraph.LinearAttention`` node, built on ``tape`` as a
    ``Scan`` over T (see the module docstring)."""
    q, k, v, past, decay, beta = (list(node.inputs) + [None] * 6)[:6]
    heads, rule = spec.kv_num_heads, spec.update_rule
    if rule not in LinearAttentionOp.RULES:
        raise ValueError(f"LinearAttention {node.name!r}: unknown update_rule {rule!r}")
    if heads < 1 or spec.q_num_heads % heads:
        raise ValueError(
            f"LinearAttention {node.name!r}: q_num_heads {spec.q_num_heads} is not a multiple"
            f" of kv_num_heads {heads}"
        )
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    if (gated and decay is None) or (delta and beta is None):
        raise ValueError(f"LinearAttention {node.name!r}: rule {rule!r} lacks decay or beta")
    consts = _Consts(tape, node)

    def packed(x: ir.Value, name: str, shape: list[int]) -> ir.Value:
        return tape.op("Reshape", [_to_float(tape, x), consts.ints(name, shape)])

    group = spec.q_num_heads // heads
    q5 = packed(q, "q_shape", [0, 0, heads, group, -1])  # (B, T, H, G, dk)
    k5 = packed(k, "k_shape", [0, 0, heads, -1, 1])  # (B, T, H, dk, 1)
    v5 = packed(v, "v_shape", [0, 0, heads, 1, -1])  # (B, T, H, 1, dv)
    scans = [tape.op("Mul", [q5, _scale(tape, consts, q, q5, spec)])]
    scans += [k5, v5]
    if gated:  # (B, T, H, dk or 1, 1)
        scans.append(tape.op("Exp", [packed(decay, "decay_shape", [0, 0, heads, -1, 1])]))
    if delta:  # (B, T, H or 1, 1, 1)
        scans.append(packed(beta, "beta_shape", [0, 0, -1, 1, 1]))
    if past is None:
        state = _zero_state(tape, consts, q, k5, v5, heads)
    else:
        state = _to_float(tape, past)
    present, y5 = tape.op_multi_out(
        "Scan",
        [state, *scans],
        {
            "body": _scan_body(f"{consts.prefix}_scan", gated=gated, delta=delta),
            "num_scan_inputs": len(scans),
            "scan_input_axes": [1] * len(scans),
            "scan_output_axes": [1],
        },
        num_outputs=2,
    )
    y = tape.op("Reshape", [y5, consts.ints("y_shape", [0, 0, -1])])  # (B, T, Hq·dv)
    state_type = past.dtype if past is not None else node.outputs[1].dtype
    y = _cast_back(tape, y, node.outputs[0], q.dtype)
    present = _cast_back(tape, present, node.outputs[1], state_type)
    logger.debug("LinearAttention %s (%s): Scan over T", node.name, rule)
    return y, present


def standard_causal_conv(
    tape: ir.tape.Tape, node: ir.Node, spec: CausalConvOp
) -> tuple[ir.Value, ir.Value]:
    """(y, present_state) of a ``tfgraph.CausalConv`` node, built on ``tape`` as ``Concat`` +
    depthwise ``Conv`` + ``Slice`` (see the module docstring)."""
    x, weight, bias, past = (list(node.inputs) + [None] * 4)[:4]
    shape = weight.shape
    if shape is None or len(shape) != 3 or not all(isinstance(d, int) for d in shape):
        raise ValueError(f"CausalConv {node.name!r}: weight needs a static (C, 1, K) shape")
    channels, kernel = shape[0], shape[2]
    if kernel < 2:
        raise ValueError(f"CausalConv {node.name!r}: K = {kernel} carries no state")
    if spec.activation not in ("none", "silu", "swish"):
        raise ValueError(f"CausalConv {node.name!r}: unknown activation {spec.activation!r}")
    consts = _Consts(tape, node)
    if past is None:  # zeros (B, C, K − 1)
        dims = [
            tape.op("Shape", [x], {"start": 0, "end": 2}),
            consts.ints("state_len", [kernel - 1]),
        ]
        zero = ir.tensor(np.zeros(1, dtype=(x.dtype or FLOAT).numpy()))
        past = tape.op("ConstantOfShape", [tape.op("Concat", dims, {"axis": 0})], {"value": zero})
    padded = tape.op("Concat", [past, x], {"axis": 2})  # (B, C, K − 1 + T)
    conv_inputs = [padded, weight] + ([bias] if bias is not None else [])
    y = tape.op("Conv", conv_inputs, {"group": channels, "kernel_shape": [kernel]})  # (B, C, T)
    if spec.activation != "none":
        y = tape.op("Mul", [y, tape.op("Sigmoid", [y])])
    starts, ends = consts.ints("state_start", [1 - kernel]), consts.ints("state_end", [_INT64_MAX])
    present = tape.op("Slice", [padded, starts, ends, consts.ints("state_axis", [2])])
    for new, old in ((y, node.outputs[0]), (present, node.outputs[1])):
        new.type, new.shape = old.type, old.shape
    logger.debug("CausalConv %s (K=%d): Concat + Conv + Slice", node.name, kernel)
    return y, present


def _prefix(node: ir.Node) -> str:
    """What new names start with: the node's name, else its output's (unique in the graph)."""
    return node.name or node.outputs[0].name or node.op_type.lower()


def _scan_body(prefix: str, *, gated: bool, delta: bool) -> ir.Graph:
    """One token of the recurrence: (S, q, k, v[, a][, β]) → (S', y). Every value is named
    after the canonical node (TensorRT's parser keeps one namespace for all graphs)."""
    body = ir.tape.Tape()

    def given(name: str) -> ir.Value:
        return ir.Value(
            name=f"{prefix}_{name}", type=ir.TensorType(FLOAT), shape=ir.Shape([None] * 4)
        )

    state, q, k, v = given("state"), given("q"), given("k"), given("v")
    inputs = [state, q, k, v]  # (B, H, dk, dv), (B, H, G, dk), (B, H, dk, 1), (B, H, 1, dv)
    s = state
    if gated:
        decay = given("decay")  # (B, H, dk or 1, 1)
        inputs.append(decay)
        s = body.op("Mul", [decay, s])
    if delta:
        beta = given("beta")  # (B, H or 1, 1, 1)
        inputs.append(beta)
        k_row = body.op("Transpose", [k], {"perm": [0, 1, 3, 2]})  # (B, H, 1, dk)
        error = body.op("Sub", [v, body.op("MatMul", [k_row, s])])  # (B, H, 1, dv)
        v = body.op("Mul", [beta, error])
    s = body.op("Add", [s, body.op("MatMul", [k, v])])  # (B, H, dk, dv)
    y = body.op("MatMul", [q, s])  # (B, H, G, dv)
    for i, new in enumerate(body.nodes):
        new.outputs[0].name = f"{prefix}_{new.op_type.lower()}{i}"
        new.outputs[0].type = ir.TensorType(FLOAT)
    s.shape, y.shape = ir.Shape([None] * 4), ir.Shape([None] * 4)  # the checker wants ranks
    return ir.Graph(inputs, [s, y], nodes=body.nodes, name=f"{prefix}_body")


def _scale(
    tape: ir.tape.Tape, consts: _Consts, q: ir.Value, q5: ir.Value, spec: LinearAttentionOp
) -> ir.Value:
    """``scale``, or 1/√dk when it is 0 (from q's static width, else from its shape)."""
    if spec.scale:
        return consts.const("scale", np.asarray(spec.scale, dtype=np.float32))
    width = q.shape[-1] if q.shape is not None and len(q.shape) else None
    if isinstance(width, int):
        dk = width // spec.q_num_heads
        return consts.const("scale", np.asarray(1 / np.sqrt(dk), dtype=np.float32))
    dk = tape.op("Cast", [tape.op("Shape", [q5], {"start": -1})], {"to": FLOAT})
    return tape.op("Reciprocal", [tape.op("Sqrt", [dk])])


def _zero_state(
    tape: ir.tape.Tape, consts: _Consts, q: ir.Value, k5: ir.Value, v5: ir.Value, heads: int
) -> ir.Value:
    """Zeros (B, H, dk, dv), the dims read with ``Shape``."""
    dims = [
        tape.op("Shape", [q], {"start": 0, "end": 1}),
        consts.ints("heads", [heads]),
        tape.op("Shape", [k5], {"start": 3, "end": 4}),
        tape.op("Shape", [v5], {"start": 4, "end": 5}),
    ]
    zero = ir.tensor(np.zeros(1, dtype=np.float32))
    return tape.op("ConstantOfShape", [tape.op("Concat", dims, {"axis": 0})], {"value": zero})


def _to_float(tape: ir.tape.Tape, x: ir.Value) -> ir.Value:
    if x.dtype is None or x.dtype == FLOAT:
        return x
    return tape.op("Cast", [x], {"to": FLOAT})


def _cast_back(
    tape: ir.tape.Tape, x: ir.Value, old: ir.Value, dtype: ir.DataType | None
) -> ir.Value:
    """``x`` (float32) in the canonical output's type, with its known shape."""
    dtype = old.dtype or dtype or FLOAT
    if dtype != FLOAT:
        x = tape.op("Cast", [x], {"to": dtype})
    x.dtype = dtype
    if old.shape is not None:
        x.shape = old.shape
    return x
