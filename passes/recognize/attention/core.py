"""The core attention rule: ``Softmax(scale·Q·Kᵀ [+ bias]) · V`` into ``tfgraph.Attention``.

Canonical op: ``tfgraph.Attention(Q, K, V[, bias])`` with Q (B, Hq, T, d), K and V
(B, Hkv, S, d) — not expanded for GQA/MQA — and ``Y = softmax(scale·Q·Kᵀ + bias)·V`` of shape
(B, Hq, T, d). Attributes: ``num_heads``, ``kv_num_heads``, ``scale``, ``causal`` (0/1),
``causal_alignment`` (``bottom_right``), ``window`` (0: none), ``bias_kind`` (``none`` or
``additive`` here; :mod:`.classify_bias` refines it by evaluating the bias).

Core form (every exporter form seen: explicit math, SDPA's decomposition, HF eager/sdpa)::

    Q ─► [Mul(·, c_q)] ─┐
                        MatMul ─► [Div(·, c) | Mul(·, c)] ─► [Add(·, bias)] ─► Softmax(-1) ─┐
    Kᵀ ─► [Mul(·, c_k)] ┘                    (HF: Where(IsNaN(p), 0, p) after it) ──────────┤
    V ──────────────────────────────────────────────────────────────────────────── MatMul ─► Y

``scale = c_q · c_k · (1/c or c)`` (1 when there is none: T5). Soft-capped scores
(``cap · tanh(scores / cap)`` after the scale, before the bias: Gemma 2) give ``softcap``.
K is ``Transpose(Kᵀ)``; the layout rules (:mod:`.kv_layouts`) cancel it against the
transposes that produced Kᵀ, and absorb the ``repeat_interleave`` that expands KV heads for
GQA/MQA. The ``flat`` variant takes Q, Kᵀ, V of another rank (heads folded into the batch, or
a window axis beside them) on one-head 4-D views.

Rejections (``check`` reasons): Softmax not over the last axis; scale factors not constant
scalars; Q, Kᵀ or V not 4-D with static head count and head size; Q's heads not a positive
multiple of K's and V's (which must agree: MatMul would broadcast one Q head over many K heads);
a NaN guard other than 0.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from tfgraph.passes.canonical import DOMAIN, AttentionOp
from tfgraph.passes.rewrite_utils import same_dims, scalar


def _rank4_static_heads(value: ir.Value) -> bool:
    shape = value.shape
    return shape is not None and len(shape) == 4 and isinstance(shape[1], int)


class AttentionRule(pattern.RewriteRuleClassBase):
    """One instance per (bias, NaN guard): onnxscript's matcher cannot make the root or an
    optional input an alternative."""

    def __init__(
        self, with_bias: bool, nan_guard: bool, sink: bool = False, flat: bool = False
    ) -> None:
        name = f"Attention{'Bias' if with_bias else ''}{'NanGuard' if nan_guard else ''}"
        super().__init__(name + ("Sink" if sink else "") + ("Flat" if flat else ""))
        self._with_bias, self._nan_guard, self._sink = with_bias, nan_guard, sink
        self._flat = flat

    def pattern(self, op, q, c_q, kt, c_k, extra, c, cap_in, cap_out, bias, v, zero, sink):
        qs = pattern.OrValue([op.Mul(q, c_q), q], tag_var="q_scaled", tag_values=[True, False])
        kts = pattern.OrValue([op.Mul(kt, c_k), kt], tag_var="k_scaled", tag_values=[True, False])
        scores = op.MatMul(qs, kts)
        scores = pattern.OrValue(  # Shaw: (Q·Kᵀ + Q·Rᵀ) / √d, the extra term scaled too
            [op.Add(scores, extra), scores], tag_var="has_extra", tag_values=[True, False]
        )
        scores = pattern.OrValue(
            [op.Div(scores, c), op.Mul(scores, c), scores],
            tag_var="scale_op",
            tag_values=["div", "mul", "none"],
        )
        scores = pattern.OrValue(  # soft-capping (Gemma 2): cap · tanh(scores / cap)
            [
                op.Mul(op.Tanh(op.Div(scores, cap_in)), cap_out),
                op.Mul(op.Tanh(op.Mul(scores, cap_in)), cap_out),
                scores,
            ],
            tag_var="softcap_op",
            tag_values=["div", "mul", "none"],
        )
        if self._with_bias:
            scores = op.Add(scores, bias)
        if self._sink:  # attention sinks (:mod:`.sink`)
            probs = op.SinkSoftmax(scores, sink, _domain=DOMAIN, _outputs=["probs"])
        else:
            probs = op.Softmax(scores, _outputs=["probs"])
        if self._nan_guard:
            probs = op.Where(op.IsNaN(probs), zero, probs)
        return op.MatMul(probs, v)

    def check(
        self, context, q, kt, v, probs, q_scaled, k_scaled, scale_op, has_extra, softcap_op, **kw
    ):
        result = pattern.MatchResult()
        self._softcap = 0.0
        if softcap_op != "none":
            inner, outer = scalar(kw["cap_in"]), scalar(kw["cap_out"])
            if inner is None or outer is None or outer <= 0:
                return result.fail("the soft-cap is not a positive constant scalar", kw["cap_out"])
            want = outer if softcap_op == "div" else 1.0 / outer
            if abs(inner - want) > 1e-6 * abs(want):
                return result.fail("tanh's input is not scaled by 1/cap of its output", q)
            self._softcap = float(outer)
            if has_extra:  # the canonical op caps Q·Kᵀ alone and adds its bias after the cap
                return result.fail(
                    "an extra score term (Shaw's q·r) inside the soft-cap: the capped op adds "
                    "its bias after the tanh",
                    q,
                )
        if has_extra and (q_scaled or k_scaled):
            return result.fail("an extra score term with Q or K pre-scaled", q)
        rank = len(probs.shape) if probs.shape is not None else 4
        axis = probs.producer().attributes.get_int("axis", -1)
        if axis not in (-1, rank - 1):
            return result.fail(f"softmax over axis {axis}, not the key axis", probs)
        scale = 1.0
        for used, name in ((q_scaled, "c_q"), (k_scaled, "c_k"), (scale_op != "none", "c")):
            if not used:
                continue
            factor = scalar(kw[name])
            if factor is None:
                return result.fail("the score scale is not a constant scalar", kw[name])
            scale *= 1.0 / factor if (name == "c" and scale_op == "div") else factor
        if self._nan_guard and scalar(kw["zero"]) != 0.0:
            return result.fail("the softmax NaN guard does not write 0", kw["zero"])
        if self._flat:
            if not _flat_batches(q, kt, v):
                return result.fail(
                    "Q, Kᵀ and V are not (…, seq, d) with the same leading dims, other than 4-D",
                    q,
                )
            self._scale = scale
            return result
        for value, what in ((q, "Q"), (kt, "Kᵀ"), (v, "V")):
            if not _rank4_static_heads(value):
                return result.fail(f"{what} is not 4-D (B, heads, seq, d) with static heads", value)
        hq, hk, hv = q.shape[1], kt.shape[1], v.shape[1]
        if hk != hv or hk <= 0 or hq <= 0 or hq % hk:
            return result.fail(
                f"Q's head count {hq} is not a positive multiple of K's and V's ({hk}, {hv})", q
            )
        self._scale = scale
        return result

    def rewrite(self, op, q, kt, v, has_extra, bias=None, extra=None, sink=None, **_):
        if has_extra:  # an activation-dependent score term (Shaw) becomes part of the bias
            scale = op.Constant(value=ir.tensor(self._scale, dtype=q.dtype))
            scaled = op.Mul(extra, scale)
            bias = scaled if bias is None else op.Add(scaled, bias)
        if self._flat:
            return _flat_attention(op, q, kt, v, bias, self._scale, self._softcap)
        k = op.Transpose(kt, perm=[0, 1, 3, 2])
        b, h, d, s = kt.shape
        k.shape = ir.Shape([b, h, s, d])  # lowering proves S == T from these symbols
        k.type = kt.type
        inputs = [q, k, v] + ([bias] if bias is not None else [])
        if sink is not None:
            inputs = [q, k, v, bias, sink]  # an empty bias slot when there is no bias
        spec = AttentionOp(
            num_heads=q.shape[1],
            kv_num_heads=kt.shape[1],
            scale=float(self._scale),
            bias_kind="additive" if bias is not None else "none",
            softcap=self._softcap,
        )
        return spec.make(op, *inputs)


def _flat_batches(q: ir.Value, kt: ir.Value, v: ir.Value) -> bool:
    """Q (…, T, d), Kᵀ (…, d, S), V (…, S, dv): one rank other than 4, at least 3, and the
    same leading dims (no broadcasting between them)."""
    shapes = [x.shape for x in (q, kt, v)]
    if any(shape is None for shape in shapes):
        return False
    rank = len(shapes[0])
    if rank < 3 or rank == 4 or any(len(shape) != rank for shape in shapes):
        return False
    return all(same_dims(shapes[0][:-2], shape[:-2]) for shape in shapes[1:])


def _flat_attention(op, q, kt, v, bias, scale: float, softcap: float):
    """``tfgraph.Attention`` on one-head 4-D views (N, 1, ·, ·) of Q, K, V whose leading dims
    (heads folded into the batch: ``F.multi_head_attention_forward``'s (B·H, T, d); or a
    window axis beside the heads: Hiera's (B, H, W, T, d)) flatten into N; the bias is
    expanded to the scores' shape first, so it flattens the same way; Y is viewed back."""
    i64 = ir.DataType.INT64
    lead = q.shape[:-2]
    rows = lead[0] if len(lead) == 1 else None
    if all(isinstance(dim, int) for dim in lead):
        rows = int(np.prod(lead))
    batch = rows if rows is not None else ir.SymbolicDim(f"{q.name}_rows")
    minus_one_one = op.Constant(value=ir.tensor([-1, 1], dtype=i64))

    def view(x, last2):  # (…, a, b) → (N, 1, a, b)
        shape = op.Concat(minus_one_one, op.Shape(x, start=-2), axis=0)
        y = op.Reshape(x, shape)
        y.shape, y.type = ir.Shape([batch, 1, *last2]), x.type
        return y

    t, d = q.shape[-2:]
    dk, s = kt.shape[-2:]
    q4, v4 = view(q, [t, d]), view(v, v.shape[-2:])
    k = op.Transpose(view(kt, [dk, s]), perm=[0, 1, 3, 2])
    k.shape, k.type = ir.Shape([batch, 1, s, dk]), kt.type
    inputs = [q4, k, v4]
    if bias is not None:
        scores_shape = op.Concat(op.Shape(q, end=-1), op.Shape(kt, start=-1), axis=0)
        full = op.Expand(bias, scores_shape)
        full.shape, full.type = ir.Shape([*lead, t, s]), bias.type
        inputs.append(view(full, [t, s]))
    spec = AttentionOp(
        num_heads=1,
        kv_num_heads=1,
        scale=float(scale),
        bias_kind="additive" if bias is not None else "none",
        softcap=softcap,
    )
    y4 = spec.make(op, *inputs)
    y4.shape, y4.type = ir.Shape([batch, 1, t, v.shape[-1]]), q.type
    out_shape = op.Concat(op.Shape(q, end=-1), op.Shape(v, start=-1), axis=0)
    y = op.Reshape(y4, out_shape)
    y.shape, y.type = ir.Shape([*lead, t, v.shape[-1]]), q.type
    return y
