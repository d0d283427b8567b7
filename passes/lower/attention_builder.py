"""``AttentionBuilder``: what every target's attention lowering builds with, on one tape.

:class:`~.lower_attention.LowerAttentionPass` hands each target an :class:`AttentionBuilder`
for the canonical node it lowers (``AttentionCase.build``). It holds the target-neutral
pieces, standard ONNX only:

- constants named after the node, shape reads, the (B, H, S, d) ↔ (B, S, H·d) layouts and the
  repeat-interleave of KV heads;
- :meth:`~AttentionBuilder.causal_window_mask` / :meth:`~AttentionBuilder.full_mask`: the
  causal/window mask as ``Where(masked, lowest, 0)`` over ``Range(T) × Range(S)`` (the dtype's
  lowest finite value, so a fully masked row gives no NaN), added to the bias;
- :meth:`~AttentionBuilder.attention23`: ONNX ``Attention``-23 on the 4-D inputs;
- :meth:`~AttentionBuilder.decomposed`: standard ops, scale folded into Q (what TensorRT's own
  MHA fusion takes), the fallback every target may use::

       Q ─ Mul(scale) ─► MatMul ─► Add(mask) ─► Softmax(−1) ─► MatMul ─► Y
       K ─ expand heads ─ Transpose ─┘                              │
       V ─ expand heads ────────────────────────────────────────────┘

A target's own kernels are built by its folder from these pieces (``ort``:
``tfgraph.exporters.ort.attention_gqa`` and ``attention_mha``).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tfgraph.passes.cache.row_lengths import row_lengths_value
from tfgraph.passes.canonical import AttentionOp
from tfgraph.passes.recognize.attention.sink import sink_softmax_ops


def dim_at(value: ir.Value, axis: int):
    """Dim ``axis`` of ``value``'s shape (an int or a symbol); ``None`` when unknown."""
    shape = value.shape
    return None if shape is None or len(shape) <= axis else shape[axis]


def dims_equal(x, y) -> bool:
    """Whether two dims are provably equal: equal ints, or the same named symbol."""
    if x is None or y is None:
        return False
    if isinstance(x, int) or isinstance(y, int):
        return x == y
    return x.value is not None and x.value == y.value


def same_dim(a: ir.Value, b: ir.Value, axis: int) -> bool:
    """Dim ``axis`` of ``a`` and of ``b`` are provably equal."""
    return dims_equal(dim_at(a, axis), dim_at(b, axis))


def has_full_query_axis(bias: ir.Value, q: ir.Value, k: ir.Value) -> bool:
    """Whether ``bias`` is provably 4-D (…, T, S): what fused kernels (ONNX Runtime's)
    accept as is, with no broadcast over the query axis."""
    if bias.shape is None or len(bias.shape) != 4:
        return False
    return dims_equal(bias.shape[2], dim_at(q, 2)) and dims_equal(bias.shape[3], dim_at(k, 2))


class AttentionBuilder:
    """Builds the replacement of one canonical node on a tape."""

    def __init__(self, graph: ir.Graph, prefix: str, q: ir.Value, k: ir.Value) -> None:
        self.tape = ir.tape.Tape()
        self.graph = graph
        self.prefix = prefix
        self.q, self.k = q, k
        self.dtype = q.dtype or ir.DataType.FLOAT
        self._consts: dict[str, ir.Value] = {}

    # -- constants and shapes -------------------------------------------------------------
    def const(self, name: str, array: np.ndarray) -> ir.Value:
        """An initializer named after the node; one per ``name`` on this tape."""
        if name in self._consts:
            return self._consts[name]
        unique, i = f"{self.prefix}_{name}", 0
        while unique in self.graph.initializers:
            i += 1
            unique = f"{self.prefix}_{name}_{i}"
        self._consts[name] = self.tape.initializer(ir.tensor(array), name=unique)
        return self._consts[name]

    def ints(self, name: str, values) -> ir.Value:
        return self.const(name, np.asarray(values, dtype=np.int64))

    def scalar(self, name: str, value: float) -> ir.Value:
        return self.const(name, np.asarray(value, dtype=self.dtype.numpy()))

    def dim(self, x: ir.Value, axis: int) -> ir.Value:
        """Dim ``axis`` of ``x`` as a 1-D int64 tensor of one element."""
        return self.tape.op("Shape", [x], {"start": axis, "end": axis + 1})

    def dim0d(self, x: ir.Value, axis: int) -> ir.Value:
        """Dim ``axis`` of ``x`` as an int64 scalar (for ``Range``)."""
        index = self.ints(f"index{axis}", axis)
        return self.tape.op("Gather", [self.tape.op("Shape", [x]), index], {"axis": 0})

    # -- layouts ----------------------------------------------------------------------------
    def to_bsh(self, x: ir.Value, name: str) -> ir.Value:
        """(B, H, S, d) → (B, S, H·d)."""
        t = self.tape.op("Transpose", [x], {"perm": [0, 2, 1, 3]})
        return self.tape.op("Reshape", [t, self.ints(f"{name}_bsh", [0, 0, -1])])

    def from_bsh(self, y: ir.Value, heads: int) -> ir.Value:
        """(B, T, H·d) → (B, H, T, d)."""
        y = self.tape.op("Reshape", [y, self.ints("y_bthd", [0, 0, heads, -1])])
        return self.tape.op("Transpose", [y], {"perm": [0, 2, 1, 3]})

    def repeat_heads5(self, x: ir.Value, spec: AttentionOp) -> ir.Value:
        """(B, Hkv, S, d) → (B, Hkv, g, S, d): flattening (Hkv, g) gives query head h the KV
        head h // g (repeat-interleave)."""
        x = self.tape.op("Unsqueeze", [x, self.ints("axis2", [2])])
        return self.tape.op("Expand", [x, self.ints("groups", [1, 1, spec.group, 1, 1])])

    def expand_heads(self, x: ir.Value, spec: AttentionOp, name: str) -> ir.Value:
        """(B, Hkv, S, d) → (B, Hq, S, d) by repeat-interleave (identity when Hkv == Hq)."""
        if spec.group == 1:
            return x
        shape = self.tape.op(
            "Concat",
            [
                self.dim(x, 0),
                self.ints("heads", [spec.num_heads, -1]),
                self.tape.op("Shape", [x], {"start": 3}),
            ],
            {"axis": 0},
        )
        return self.tape.op("Reshape", [self.repeat_heads5(x, spec), shape])  # (B, Hq, S, d)

    def expand_heads_bsh(self, x: ir.Value, spec: AttentionOp, name: str) -> ir.Value:
        """(B, Hkv, S, d) → (B, S, Hq·d), heads repeat-interleaved, with a single Transpose."""
        if spec.group == 1:
            return self.to_bsh(x, name)
        x5 = self.repeat_heads5(x, spec)
        t = self.tape.op("Transpose", [x5], {"perm": [0, 3, 1, 2, 4]})  # (B, S, Hkv, g, d)
        return self.tape.op("Reshape", [t, self.ints(f"{name}_bsh", [0, 0, -1])])

    # -- masks ------------------------------------------------------------------------------
    def causal_window_mask(
        self, spec: AttentionOp, *, causal: bool, window: int
    ) -> ir.Value | None:
        """The additive (T, S) mask: 0 where visible, the dtype's lowest value where masked.
        A cached layer whose rows have their own past lengths (:mod:`~.cache.row_lengths`) gets a
        (B, 1, T, S) mask: row b's query i sits at P_b + i, and keys after it are masked
        (whatever the buffer holds there)."""
        if not causal and not window:
            return None
        tape = self.tape
        zero, one = self.ints("zero", 0), self.ints("one", 1)
        t, s = self.dim0d(self.q, 2), self.dim0d(self.k, 2)
        i = tape.op("Unsqueeze", [tape.op("Range", [zero, t, one]), self.ints("axis1", [1])])
        j = tape.op("Range", [zero, s, one])
        rows = row_lengths_value(self.graph) if spec.cached else None
        if rows is not None:  # (P_b + i) − j, (B, 1, T, S)
            at = tape.op("Unsqueeze", [rows, self.ints("axes123", [1, 2, 3])])
            behind = tape.op("Sub", [tape.op("Add", [at, i]), j])
        else:
            # (i + S − T) − j: how far key j lies behind query i, aligned bottom-right.  (T, S)
            behind = tape.op("Sub", [tape.op("Add", [i, tape.op("Sub", [s, t])]), j])
        masked = None
        if causal:
            masked = (
                tape.op("Less", [behind, zero]) if spec.bottom_right else tape.op("Less", [i, j])
            )
        if window:
            outside = tape.op("GreaterOrEqual", [behind, self.ints("window", window)])
            masked = outside if masked is None else tape.op("Or", [masked, outside])
        lowest = float(np.finfo(self.dtype.numpy()).min)
        return tape.op("Where", [masked, self.scalar("lowest", lowest), self.scalar("zero_f", 0)])

    def full_mask(
        self, bias: ir.Value | None, spec: AttentionOp, *, causal: bool, window: int
    ) -> ir.Value | None:
        """bias + causal/window mask as a 4-D (…, T, S) tensor, since ORT's fused kernels
        reject a mask that broadcasts over the query axis; None when there is nothing."""
        mask = self.causal_window_mask(spec, causal=causal, window=window)
        if mask is not None:
            if not (spec.cached and row_lengths_value(self.graph) is not None):  # else (B,1,T,S)
                mask = self.tape.op("Unsqueeze", [mask, self.ints("axes01", [0, 1])])  # (1,1,T,S)
            return mask if bias is None else self.tape.op("Add", [bias, mask])
        if bias is None or has_full_query_axis(bias, self.q, self.k):
            return bias
        shape = self.tape.op(
            "Concat",
            [self.ints("ones2", [1, 1]), self.dim(self.q, 2), self.dim(self.k, 2)],
            {"axis": 0},
        )
        return self.tape.op("Expand", [bias, shape])  # (B or 1, Hq or 1, T, S)

    # -- standard forms ---------------------------------------------------------------------
    def attention23(self, v: ir.Value, bias: ir.Value | None, spec: AttentionOp) -> ir.Value:
        """ONNX Attention-23; its ``is_causal`` (no past) is top-left, so a bottom-right mask
        with S ≠ T, or a window, is passed as ``attn_mask``."""
        self_attention = same_dim(self.q, self.k, 2)
        native = spec.causal and not spec.window and (not spec.bottom_right or self_attention)
        if native:
            mask = self.full_mask(bias, spec, causal=False, window=0)
        else:
            mask = self.full_mask(bias, spec, causal=spec.causal, window=spec.window)
        inputs = [self.q, self.k, v] + ([mask] if mask is not None else [])
        attrs = {"scale": spec.scale, "is_causal": int(native)}
        if spec.softcap:
            attrs["softcap"] = spec.softcap
        return self.tape.op("Attention", inputs, attrs)

    def decomposed(
        self, v: ir.Value, bias: ir.Value | None, spec: AttentionOp, sink: ir.Value | None = None
    ) -> ir.Value:
        """Standard ops in the order TensorRT's MHA fusion wants (scale on Q, one mask Add);
        a sink is a column concatenated to the scores, dropped after the softmax."""
        tape = self.tape
        q = self.q
        if spec.scale != 1.0:
            q = tape.op("Mul", [q, self.scalar("scale", spec.scale)])
        k = tape.op("Transpose", [self.expand_heads(self.k, spec, "k")], {"perm": [0, 1, 3, 2]})
        scores = tape.op("MatMul", [q, k])  # (B, Hq, T, S)
        if spec.softcap:
            inner = tape.op("Mul", [scores, self.scalar("inv_softcap", 1.0 / spec.softcap)])
            scores = tape.op(
                "Mul", [tape.op("Tanh", [inner]), self.scalar("softcap", spec.softcap)]
            )
        mask = self.causal_window_mask(spec, causal=spec.causal, window=spec.window)
        if mask is not None and bias is not None:
            mask = tape.op("Add", [bias, mask])
        elif mask is None:
            mask = bias
        if mask is not None:
            scores = tape.op("Add", [scores, mask])
        if sink is not None:
            probs = sink_softmax_ops(tape, scores, sink, self.ints)
        else:
            probs = tape.op("Softmax", [scores], {"axis": -1})
        return tape.op("MatMul", [probs, self.expand_heads(v, spec, "v")])
