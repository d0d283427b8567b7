"""Rules that recognize an attention core and rewrite it into ONE canonical ``tfgraph`` op.

Canonical op: ``tfgraph.Attention(Q, K, V[, bias])`` with Q (B, Hq, T, d), K and V
(B, Hkv, S, d) — not expanded for GQA/MQA — and ``Y = softmax(scale·Q·Kᵀ + bias)·V`` of shape
(B, Hq, T, d). Attributes: ``num_heads``, ``kv_num_heads``, ``scale``, ``causal`` (0/1),
``causal_alignment`` (``bottom_right``), ``window`` (0: none), ``bias_kind`` (``none`` or
``additive`` here; :mod:`.classify_attention_bias` refines it by evaluating the bias).

Core form (every exporter form seen: explicit math, SDPA's decomposition, HF eager/sdpa)::

    Q ─► [Mul(·, c_q)] ─┐
                        MatMul ─► [Div(·, c) | Mul(·, c)] ─► [Add(·, bias)] ─► Softmax(-1) ─┐
    Kᵀ ─► [Mul(·, c_k)] ┘                    (HF: Where(IsNaN(p), 0, p) after it) ──────────┤
    V ──────────────────────────────────────────────────────────────────────────── MatMul ─► Y

``scale = c_q · c_k · (1/c or c)`` (1 when there is none: T5). Soft-capped scores
(``cap · tanh(scores / cap)`` after the scale, before the bias: Gemma 2) give ``softcap``.
K is ``Transpose(Kᵀ)``; the layout rules below cancel it against the transposes that produced
Kᵀ, and absorb the
``repeat_interleave`` that expands KV heads for GQA/MQA.

Rejections (``check`` reasons): Softmax not over the last axis; scale factors not constant
scalars; Q, Kᵀ or V not 4-D with static head count and head size; Q's heads not a positive
multiple of K's and V's (which must agree: MatMul would broadcast one Q head over many K heads);
a NaN guard other than 0. Layout rules: SDPA's reshapes of K not exactly the merge of (B, H)
and its split back; a ``repeat_kv`` whose final reshape does not merge exactly the repeat axis
into the heads, keeping S and d.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from tfgraph.passes.canonical import DOMAIN, AttentionOp
from tfgraph.passes.rewrite_utils import constant, int_list, same_dims, scalar


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
        if self._sink:  # attention sinks (:mod:`.sink_rules`)
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


class BatchedHeadsAttentionRule(pattern.RewriteRuleClassBase):
    """BLOOM's layout: heads folded into the batch, ``baddbmm`` adding ALiBi before the view::

        q3 (B·H, T, d), kᵀ3 (B·H, d, S)
        s = Reshape(Mul(MatMul(q3, kᵀ3), c) + alibi3, (B, H, T, S)) + mask
        y = Reshape(MatMul(Reshape(Softmax(s), (B·H, T, S)), v3), (B, H, T, d))

    becomes ``tfgraph.Attention`` on 4-D views of q3, k3, v3 with ``bias = alibi + mask``.
    """

    def pattern(self, op, q3, kt3, c, alibi3, s4, mask, s3, v3, so):
        scores3 = op.Add(op.Mul(op.MatMul(q3, kt3), c), alibi3)
        scores = op.Add(op.Reshape(scores3, s4, _outputs=["scores4"]), mask)
        probs3 = op.Reshape(op.Softmax(scores, _outputs=["probs"]), s3)
        return op.Reshape(op.MatMul(probs3, v3), so, _outputs=["y4"])

    def check(self, context, q3, kt3, v3, c, scores4, y4, probs, **_):
        result = pattern.MatchResult()
        if probs.producer().attributes.get_int("axis", -1) not in (-1, 3):
            return result.fail("softmax is not over the key axis", probs)
        if scalar(c) is None:
            return result.fail("the score scale is not a constant scalar", c)
        for value in (q3, kt3, v3):
            if value.shape is None or len(value.shape) != 3:
                return result.fail("Q, Kᵀ, V are not 3-D (batch·heads, seq, d)", value)
        for value in (scores4, y4):
            if value.shape is None or len(value.shape) != 4 or not isinstance(value.shape[1], int):
                return result.fail("the 4-D views have no static head count", value)
        self._heads, self._scale = scores4.shape[1], scalar(c)
        return result

    def rewrite(self, op, q3, kt3, v3, alibi3, mask, scores4, **_):
        def bias(heads):
            return op.Add(heads(alibi3, alibi3.shape[1:]), mask)

        return _batched_heads(op, q3, kt3, v3, scores4, self._heads, self._scale, bias)


class BatchedScoresAttentionRule(pattern.RewriteRuleClassBase):
    """GPT-NeoX-Japanese's layout: only the scores are batched over heads (``baddbmm`` from
    zeros, which :mod:`tfgraph.passes.recognize.exact_no_op` drops), the probabilities multiply a 4-D V::

        s = Reshape(Mul(MatMul(q3, kᵀ3), c), (B, H, T, S)) + mask
        y = MatMul(Softmax(s), V)        V (B, H, S, d)

    becomes ``tfgraph.Attention`` on 4-D views of q3 and kᵀ3 with ``bias = mask``: the view
    splits B·H the way the scores' own view does, so head h of the scores meets head h of V.
    Rejections: scores or V without a static head count, or with different ones; a view that
    is not the split of the scores' first axis; a softmax over another axis."""

    def pattern(self, op, q3, kt3, c, s4, mask, v):
        scores3 = op.Mul(op.MatMul(q3, kt3), c, _outputs=["scores3"])
        scores = op.Add(op.Reshape(scores3, s4, _outputs=["scores4"]), mask)
        return op.MatMul(op.Softmax(scores, _outputs=["probs"]), v)

    def check(self, context, q3, kt3, v, c, scores3, scores4, probs, **_):
        result = pattern.MatchResult()
        if probs.producer().attributes.get_int("axis", -1) not in (-1, 3):
            return result.fail("softmax is not over the key axis", probs)
        if scalar(c) is None:
            return result.fail("the score scale is not a constant scalar", c)
        for value in (q3, kt3, scores3):
            if value.shape is None or len(value.shape) != 3:
                return result.fail("Q, Kᵀ are not 3-D (batch·heads, seq, d)", value)
        for value in (scores4, v):
            if not _rank4_static_heads(value):
                return result.fail("the scores' view or V has no static head count", value)
        if scores4.shape[1] != v.shape[1]:
            return result.fail("the scores' view and V have different head counts", v)
        if not same_dims(scores3.shape[1:], scores4.shape[2:]):
            return result.fail("the scores' view is not the split of (B·H)", scores4)
        self._heads, self._scale = scores4.shape[1], scalar(c)
        return result

    def rewrite(self, op, q3, kt3, v, mask, scores4, **_):
        return _batched_heads(op, q3, kt3, v, scores4, self._heads, self._scale, lambda view: mask)


def _batched_heads(op, q3, kt3, v3, scores4, heads: int, scale: float, bias):
    """``tfgraph.Attention`` on 4-D views of (B·H, ·, ·) Q, Kᵀ, V (V as it is when it is 4-D
    already); ``bias(heads)`` builds the bias with the same view function."""
    shape = op.Constant(value=ir.tensor([-1, heads, 0, 0], dtype=ir.DataType.INT64))
    zero = op.Constant(value=ir.tensor([0], dtype=ir.DataType.INT64))
    batch = scores4.shape[0]

    def view(x, dims):  # (B·H, a, b) → (B, H, a, b), with the shape it is known to have
        y = op.Reshape(op.Unsqueeze(x, zero), shape)
        y.shape, y.type = ir.Shape([batch, heads, *dims]), x.type
        return y

    q = view(q3, q3.shape[1:])
    k = op.Transpose(view(kt3, kt3.shape[1:]), perm=[0, 1, 3, 2])
    k.shape = ir.Shape([batch, heads, kt3.shape[2], kt3.shape[1]])
    k.type = kt3.type
    v = v3 if len(v3.shape) == 4 else view(v3, v3.shape[1:])
    extra = bias(view)
    spec = AttentionOp(
        num_heads=heads,
        kv_num_heads=heads,
        scale=float(scale),
        bias_kind="additive" if extra is not None else "none",
    )
    return spec.make(op, q, k, v, *([extra] if extra is not None else []))


class BmmAttentionRule(pattern.RewriteRuleClassBase):
    """The older BART-family layout (TrOCR, XGLM, MVP): ``bmm`` on (B·H, ·, ·), the scores
    viewed as (B, H, T, S) to add the mask and back to 3-D for the softmax, Q scaled before::

        s = Reshape(Reshape(MatMul(q3, kᵀ3), (B, H, T, S)) + mask [Max(·, lowest)], (B·H, T, S))
        y = Reshape(MatMul(Softmax(s), v3), (B, H, T, d))

    becomes ``tfgraph.Attention`` (scale 1: the scale is in q3) with ``bias = mask``; a term
    added to the bmm before the view (SpeechT5's relative position bias, ``q·rᵀ``) joins the
    bias as its (B, H, T, S) view, an activation-dependent additive bias (Shaw). XGLM's
    ``Max(·, lowest)`` clamp is dropped: it only turns −inf into the lowest value, and the
    masks it guards are made of the lowest value (never −inf). Without a mask the scores stay
    3-D: ``Reshape(MatMul(Softmax(MatMul(q3, kᵀ3)), v3), (B, H, T, d))``. A round trip of the
    probabilities through a 4-D view and back (XGLM's head mask slot) is taken too.
    Rejections: a clamp at any other value; an extra term not shaped like the bmm; views
    with unknown or non-static heads, or
    splits that disagree; a softmax over another axis.
    """

    def __init__(self, masked: bool, clamp: bool = False, round_trip: bool = False) -> None:
        name = f"BmmAttention{'Masked' if masked else ''}{'Clamp' if clamp else ''}"
        super().__init__(name + ("RoundTrip" if round_trip else ""))
        self._masked, self._clamp, self._round_trip = masked, clamp, round_trip

    def pattern(self, op, q3, kt3, extra3, s4, mask, lowest, s3, v3, so, r4, r3):
        scores = op.MatMul(q3, kt3, _outputs=["bmm"])
        scores = pattern.OrValue(  # SpeechT5: + Shaw's q·r term, (B·H, T, S) like the scores
            [op.Add(scores, extra3, _outputs=["summed"]), scores],
            tag_var="has_extra",
            tag_values=[True, False],
        )
        if self._masked:
            scores = op.Add(op.Reshape(scores, s4, _outputs=["scores4"]), mask)
            if self._clamp:
                scores = op.Max(scores, lowest)
            scores = op.Reshape(scores, s3, _outputs=["scores3"])
        probs3 = op.Softmax(scores, _outputs=["probs"])
        if self._round_trip:
            probs3 = op.Reshape(op.Reshape(probs3, r4, _outputs=["probs4"]), r3, _outputs=["back"])
        return op.Reshape(op.MatMul(probs3, v3), so, _outputs=["y4"])

    def check(self, context, q3, kt3, v3, bmm, y4, probs, has_extra, scores3=None, **kw):
        result = pattern.MatchResult()
        scores3 = scores3 if scores3 is not None else bmm
        extra = kw.get("extra3") if has_extra else None
        if extra is not None and (
            extra.shape is None
            or len(extra.shape) != 3
            or bmm.shape is None
            or not same_dims(extra.shape, bmm.shape)
        ):
            return result.fail(
                "the extra score term is not (batch·heads, T, S) like the scores", extra
            )
        if probs.producer().attributes.get_int("axis", -1) not in (-1, 2):
            return result.fail("softmax is not over the key axis", probs)
        if self._clamp and not _is_fill(scalar(kw["lowest"])):
            return result.fail("the scores are clamped at a value other than the lowest", probs)
        for value in (q3, kt3, v3, scores3):
            if value.shape is None or len(value.shape) != 3:
                return result.fail("Q, Kᵀ, V are not 3-D (batch·heads, seq, d)", value)
        views = [y4] + [kw[n] for n in ("scores4", "probs4") if kw.get(n) is not None]
        for value in views:
            if value.shape is None or len(value.shape) != 4 or not isinstance(value.shape[1], int):
                return result.fail("the 4-D views have no static head count", value)
        if len({v.shape[1] for v in views}) != 1:
            return result.fail("the 4-D views split different head counts", y4)
        split = views[-1].shape
        if self._masked and list(scores3.shape[1:]) != list(kw["scores4"].shape[2:]):
            return result.fail("the softmax's view is not the scores' merge of (B, H)", scores3)
        if self._round_trip and list(kw["back"].shape[1:]) != list(split[2:]):
            return result.fail("the probabilities' round trip is not a merge of (B, H)", probs)
        self._heads, self._batch_view = y4.shape[1], kw.get("scores4") or y4
        return result

    def rewrite(self, op, q3, kt3, v3, has_extra, extra3=None, mask=None, **_):
        def bias(view):
            if not has_extra:
                return mask
            extra = view(extra3, extra3.shape[1:])
            return extra if mask is None else op.Add(extra, mask)

        return _batched_heads(op, q3, kt3, v3, self._batch_view, self._heads, 1.0, bias)


class ViewedBmmAttentionRule(pattern.RewriteRuleClassBase):
    """DeBERTa-v2's layout (SEW-D, DeBERTa): ``bmm`` on (B·H, ·, ·), the scores viewed as
    (B, H, T, S) for the mask and the softmax, the probabilities viewed back for the second
    ``bmm``, with the disentangled relative terms (c2p + p2c, computed from Q and the
    position embeddings) added to the scaled scores before the view::

        s3 = MatMul(q3 [·c_q], kᵀ3 [/c | ·c]) [+ rel3]            (B·H, T, S)
        s = Reshape(s3, (B, H, T, S)) [+ mask]
        y = Reshape(MatMul(Reshape(Softmax(s), (B·H, T, S)), v3), (B, H, T, d))

    becomes ``tfgraph.Attention`` on 4-D views of q3, k3, v3 with ``bias = view(rel3) + mask``
    (the relative term stays an activation-dependent additive bias, Shaw-style). Rejections:
    Q, Kᵀ, V or the scores not 3-D; views without a static head count, or splitting different
    ones; a view that is not the merge of (B, H); a scale that is not a constant scalar; a
    softmax over another axis.
    """

    def __init__(self, has_extra: bool, masked: bool) -> None:
        super().__init__(
            f"ViewedBmmAttention{'Extra' if has_extra else ''}{'Masked' if masked else ''}"
        )
        self._has_extra, self._masked = has_extra, masked

    def pattern(self, op, q3, c_q, kt3, c, extra3, s4, mask, s3, v3, so):
        qs = pattern.OrValue(
            [op.Mul(q3, c_q), op.Div(q3, c_q), q3],
            tag_var="q_scale",
            tag_values=["mul", "div", "none"],
        )
        kts = pattern.OrValue(
            [op.Mul(kt3, c), op.Div(kt3, c), kt3],
            tag_var="k_scale",
            tag_values=["mul", "div", "none"],
        )
        scores3 = op.MatMul(qs, kts, _outputs=["bmm"])
        if self._has_extra:
            scores3 = op.Add(scores3, extra3, _outputs=["scores3"])
        scores = op.Reshape(scores3, s4, _outputs=["scores4"])
        if self._masked:
            scores = op.Add(scores, mask)
        probs3 = op.Reshape(op.Softmax(scores, _outputs=["probs"]), s3, _outputs=["probs3"])
        return op.Reshape(op.MatMul(probs3, v3, _outputs=["y3"]), so, _outputs=["y4"])

    def check(
        self, context, q3, kt3, v3, bmm, scores4, probs, probs3, y3, y4, q_scale, k_scale, **kw
    ):
        result = pattern.MatchResult()
        if probs.producer().attributes.get_int("axis", -1) not in (-1, 3):
            return result.fail("softmax is not over the key axis", probs)
        scale = 1.0
        for how, name in ((q_scale, "c_q"), (k_scale, "c")):
            if how == "none":
                continue
            factor = scalar(kw[name])
            if factor is None or factor == 0:
                return result.fail("the score scale is not a constant scalar", kw[name])
            scale *= factor if how == "mul" else 1.0 / factor
        for value in (q3, kt3, v3, bmm, probs3, y3):
            if value.shape is None or len(value.shape) != 3:
                return result.fail("Q, Kᵀ, V or the scores are not 3-D (batch·heads, ·, ·)", value)
        for value in (scores4, probs, y4):
            if value.shape is None or len(value.shape) != 4 or not isinstance(value.shape[1], int):
                return result.fail("the 4-D views have no static head count", value)
        heads = scores4.shape[1]
        if probs.shape[1] != heads or y4.shape[1] != heads:
            return result.fail("the 4-D views split different head counts", y4)
        extra = kw.get("extra3")
        if extra is not None and (
            extra.shape is None
            or len(extra.shape) != 3
            or not same_dims(extra.shape[:1], bmm.shape[:1])
        ):
            return result.fail(
                "the relative term is not (batch·heads, T, S) like the scores", extra
            )
        merges = ((bmm, scores4), (probs3, probs), (y3, y4))
        if not all(same_dims(a.shape[1:], b.shape[2:]) for a, b in merges):
            return result.fail("a 3-D view is not the merge of (B, H) of its 4-D view", probs3)
        self._heads, self._scale = heads, scale
        return result

    def rewrite(self, op, q3, kt3, v3, scores4, extra3=None, mask=None, **_):
        def bias(view):
            extra = view(extra3, extra3.shape[1:]) if extra3 is not None else None
            if extra is None or mask is None:
                return extra if extra is not None else mask
            return op.Add(extra, mask)

        return _batched_heads(op, q3, kt3, v3, scores4, self._heads, self._scale, bias)


class DoubleTransposeRule(pattern.RewriteRuleClassBase):
    """``Transpose(Transpose(x, p1), p2)`` → ``x`` when the permutations cancel. The inner
    node may have other uses (two attentions on one K): it is left for dead-code removal."""

    def __init__(self) -> None:
        super().__init__(remove_nodes=False)

    def pattern(self, op, x):
        return op.Transpose(op.Transpose(x, _outputs=["inner"]), _outputs=["outer"])

    def check(self, context, inner, outer, **_):
        p1 = inner.producer().attributes.get_ints("perm")
        p2 = outer.producer().attributes.get_ints("perm")
        if p1 is None or p2 is None or [p1[i] for i in p2] != list(range(len(p1))):
            return pattern.MatchResult().fail("the transposes do not cancel", outer)
        return pattern.MatchResult()

    def rewrite(self, op, x, **_):
        return op.Identity(x)


class SdpaKeyLayoutRule(pattern.RewriteRuleClassBase):
    """SDPA's decomposition transposes K through a 3-D view: ``(B, H, S, d) → (B·H, S, d) →
    (B·H, d, S) → (B, H, d, S)``; transposing that back is K itself.

    Only those exact views: Reshape is row-major, so a 3-D view of K ending in (S, d) can only
    be the merge of axes 0 and 1 (its first dim is B·H by element count), and the view of
    (B·H, d, S) as (B, H, d, S) only the split of axis 0 back. Any other pair of reshapes may
    still end in Kᵀ's shape — (B, H·S, d) first, say — but scrambles the keys. The views may
    have other uses (two attentions on one K): they are left for dead-code removal."""

    def __init__(self) -> None:
        super().__init__(remove_nodes=False)

    def pattern(self, op, k, s1, s2):
        flat = op.Reshape(k, s1, _outputs=["flat"])
        kt = op.Reshape(op.Transpose(flat, perm=[0, 2, 1]), s2, _outputs=["kt"])
        return op.Transpose(kt, perm=[0, 1, 3, 2])

    def check(self, context, k, flat, kt, **_):
        if k.shape is None or kt.shape is None or len(k.shape) != 4 or len(kt.shape) != 4:
            return pattern.MatchResult().fail("K's shape is unknown", k)
        b, h, s, d = k.shape
        merged = flat.shape is not None and len(flat.shape) == 3 and list(flat.shape[1:]) == [s, d]
        if not merged or list(kt.shape) != [b, h, d, s]:
            return pattern.MatchResult().fail("the reshapes do not transpose K", kt)
        return pattern.MatchResult()

    def rewrite(self, op, k, **_):
        return op.Identity(k)


class RepeatKVRule(pattern.RewriteRuleClassBase):
    """``Attention(Q, repeat_kv(k), repeat_kv(v))`` → ``Attention(Q, k, v)`` with
    ``kv_num_heads`` = k's heads, where ``repeat_kv(x)`` is ``repeat_interleave(x, g, dim=1)``
    as exported: ``Reshape(Expand(Unsqueeze(x, [2]), (…, g, …)), (B, H·g, S, d))``.

    The final reshape must be exactly (B, Hkv·g, S, d) of x's (B, Hkv, S, d): by element count
    the expansion is then (B, Hkv, g, S, d) and the reshape merges its axes 1 and 2 only, so
    query head i reads KV head i // g. Any other target (regrouping S and d, say) is not a
    repeat of x's heads."""

    def pattern(self, op, q, k, v, ak, av, ek, ev, rk, rv):
        k_exp = op.Expand(op.Unsqueeze(k, ak), ek, _outputs=["k_exp"])
        v_exp = op.Expand(op.Unsqueeze(v, av), ev, _outputs=["v_exp"])
        k_rep = op.Reshape(k_exp, rk, _outputs=["k_rep"])
        v_rep = op.Reshape(v_exp, rv, _outputs=["v_rep"])
        # the bias and sink slots, if any, are kept as they are
        return op.Attention(
            q, k_rep, v_rep, _domain=DOMAIN, _allow_other_inputs=True, _outputs=["y"]
        )

    def check(self, context, k, v, ak, av, k_exp, v_exp, k_rep, v_rep, y, **_):
        result = pattern.MatchResult()
        if int_list(ak) != [2] or int_list(av) != [2]:
            return result.fail("KV heads are not repeated along a new axis 2", ak)
        for src, exp, rep in ((k, k_exp, k_rep), (v, v_exp, v_rep)):
            if src.shape is None or exp.shape is None or len(exp.shape) != 5:
                return result.fail("the KV expansion's shape is unknown", exp)
            if not isinstance(exp.shape[2], int) or not isinstance(src.shape[1], int):
                return result.fail("the KV repeat count is not static", exp)
            if len(src.shape) != 4 or rep.shape is None or len(rep.shape) != 4:
                return result.fail("the KV reshape does not merge the repeat into the heads", rep)
            b, hkv, s, d = src.shape
            if list(rep.shape) != [b, hkv * exp.shape[2], s, d]:
                return result.fail("the KV reshape does not merge the repeat into the heads", rep)
        node = y.producer()
        heads = node.attributes.get_int("num_heads")
        if k.shape[1] * k_exp.shape[2] != heads or v.shape[1] * v_exp.shape[2] != heads:
            return result.fail("repeated KV heads do not add up to the query heads", k)
        return result

    def rewrite(self, op, q, k, v, y, **_):
        spec = AttentionOp.read(y.producer()).replace(kv_num_heads=k.shape[1])
        return spec.make(op, q, k, v, *y.producer().inputs[3:])


_FP16_LOWEST = -65504.0


def _is_fill(value: float | None) -> bool:
    """−inf, or a dtype's lowest finite value: what masked scores are set to."""
    if value is None:
        return False
    return value == float("-inf") or value <= -3.0e38 or value == _FP16_LOWEST


_SCORE_PATH = frozenset({"Add", "Sub", "Mul", "Div", "Tanh", "Cast", "Reshape", "Where"})


def _from_scores(value: ir.Value, depth: int = 8) -> bool:
    """Whether ``value`` is computed from a ``MatMul`` (the Q·Kᵀ scores) through elementwise
    ops and views; an additive mask built as ``Where(keep, zeros, -inf)`` is not."""
    for _ in range(depth):
        node = value.producer()
        if node is None:
            return False
        if node.op_type == "MatMul":
            return True
        if node.op_type not in _SCORE_PATH or node.domain not in ("", "ai.onnx"):
            return False
        data = [i for i in node.inputs if i is not None and constant(i) is None]
        if node.op_type == "Where":
            data = data[1:]  # the condition is not the scores
        if not data:
            return False
        value = (
            data[0] if len(data) == 1 else next((d for d in data if _from_scores(d, 2)), data[0])
        )
    return False


class SelectionMaskRule(pattern.RewriteRuleClassBase):
    """Scores masked by selection become scores plus an additive mask, which the core rules
    and the bias classifier take like any other::

        Softmax(Where(keep, s, fill))  →  Softmax(Add(s, Where(keep, 0, fill)))
        Softmax(Where(drop, fill, s))  →  Softmax(Add(s, Where(drop, fill, 0)))

    (``scores.masked_fill(mask == 0, -inf)``, ``torch.where(mask, scores, finfo.min)``).
    ``fill`` must be −inf or the dtype's lowest value, so ``s + fill`` is ``fill`` where it
    counts. When ``s`` is already ``Add(t, bias)``, the mask joins the bias:
    ``Add(t, Add(bias, mask))``; a bias added after the selection (GPT-Neo's padding mask on
    its causal ``where``) joins it too: ``Softmax(Add(Where(keep, s, fill), b))`` →
    ``Softmax(Add(s, Add(Where(keep, 0, fill), b)))`` (``fill + b`` where masked, as before:
    equal to ``s + fill + b`` since ``fill`` absorbs ``s``). Rejections: a fill that is not a
    constant scalar; a finite fill above the lowest value (−10000, say: adding it is not
    selecting).
    """

    def __init__(self, fill_first: bool, then_bias: str = "") -> None:
        # then_bias: "" (none), "right" (Add(picked, b)) or "left" (Add(b, picked))
        super().__init__(f"SelectionMask{'FillFirst' if fill_first else ''}{then_bias.title()}")
        self._fill_first, self._then_bias = fill_first, then_bias

    def pattern(self, op, cond, s, fill, after):
        picked = op.Where(cond, fill, s) if self._fill_first else op.Where(cond, s, fill)
        if self._then_bias:
            picked = op.Add(picked, after) if self._then_bias == "right" else op.Add(after, picked)
        return op.Softmax(picked, _outputs=["probs"])

    def check(self, context, s, fill, **_):
        result = pattern.MatchResult()
        value = scalar(fill)
        if value is None:
            return result.fail("the masked scores' fill is not a constant scalar", fill)
        if not _is_fill(value):
            return result.fail(f"the fill {value:g} is not -inf or the dtype's lowest", fill)
        if scalar(s) is not None:
            return result.fail("the selected scores are a constant", s)
        if (s.dtype or fill.dtype) is None:
            return result.fail("the scores' type is unknown", s)
        if not _from_scores(s):  # Where(keep, 0, -inf) + scores: an additive mask, not this
            return result.fail("the selected value is not computed from Q·Kᵀ scores", s)
        return result

    def rewrite(self, op, cond, s, fill, probs, after=None, **_):
        zero = op.Constant(value=ir.tensor(0.0, dtype=s.dtype or fill.dtype))
        mask = op.Where(cond, fill, zero) if self._fill_first else op.Where(cond, zero, fill)
        if after is not None:
            mask = op.Add(mask, after)
        add = s.producer()
        if add is not None and add.op_type == "Add" and add.domain in ("", "ai.onnx"):
            scores = op.Add(add.inputs[0], op.Add(add.inputs[1], mask))
        else:
            scores = op.Add(s, mask)
        axis = probs.producer().attributes.get_int("axis", -1)
        return op.Softmax(scores, axis=axis)


_VIEWS = frozenset(
    {"Slice", "Reshape", "Cast", "Unsqueeze", "Squeeze", "Expand", "Transpose", "Identity"}
)


def _zero_one_constant(value: ir.Value, depth: int = 8) -> bool:
    """Whether ``value`` is a view (slices, reshapes, casts) of a constant whose entries are
    all 0 or 1: a registered mask buffer such as GPT-1's ``bias = tril(ones)``."""
    for _ in range(depth):
        array = constant(value)
        if array is not None:
            return array.size > 0 and bool(np.isin(array, (0, 1)).all())
        node = value.producer()
        if node is None or node.op_type not in _VIEWS or node.domain not in ("", "ai.onnx"):
            return False
        value = node.inputs[0]
    return False


class MultiplicativeMaskRule(pattern.RewriteRuleClassBase):
    """Scores kept by a 0/1 mask and filled by a large negative constant elsewhere become
    scores plus an additive mask::

        Add(Mul(s, keep), Mul(Sub(1, keep), fill))  →  Add(s, Mul(Sub(1, keep), lowest))

    (GPT-1's ``w * b + -1e4 * (1 - b)``, ``b`` a slice of its ``tril(ones)`` buffer), in either
    operand order of the ``Mul`` by ``fill``. Where ``keep`` is 1 both give ``s``; where it is
    0 the masked score becomes the dtype's lowest value instead of ``fill``: both vanish in the
    softmax (``exp(fill − max)`` underflows once the row has a visible score above
    ``fill + 104``), and the bias classifier then sees the mask it is (causal, dropped).
    Rejections: ``keep`` not a view of a constant of 0s and 1s; ``fill`` not a constant scalar
    ≤ −1e4; ``s`` not computed from Q·Kᵀ; an unknown dtype.
    """

    def __init__(self, fill_first: bool) -> None:
        super().__init__(f"MultiplicativeMask{'FillFirst' if fill_first else ''}")
        self._fill_first = fill_first

    def pattern(self, op, s, keep, one, fill):
        drop = op.Sub(one, keep)
        filled = op.Mul(fill, drop) if self._fill_first else op.Mul(drop, fill)
        return op.Add(op.Mul(s, keep), filled)

    def check(self, context, s, keep, one, fill, **_):
        result = pattern.MatchResult()
        if scalar(one) != 1.0:
            return result.fail("the complement of the mask is not 1 - keep", one)
        value = scalar(fill)
        if value is None or not value <= -1e4:
            return result.fail("the fill of the dropped scores is not a constant ≤ -1e4", fill)
        if s.dtype is None or not s.dtype.is_floating_point():
            return result.fail("the scores' type is unknown", s)
        if not _zero_one_constant(keep):
            return result.fail("the keep mask is not a constant of 0s and 1s", keep)
        if not _from_scores(s):
            return result.fail("the kept value is not computed from Q·Kᵀ scores", s)
        return result

    def rewrite(self, op, s, keep, one, **_):
        lowest = float(ml_dtypes.finfo(s.dtype.numpy()).min)
        mask = op.Mul(op.Sub(one, keep), op.Constant(value=ir.tensor(lowest, dtype=s.dtype)))
        return op.Add(s, mask)


def _selects_with(value: ir.Value, cond: ir.Value, fill_first: bool, depth: int = 4) -> bool:
    """Whether ``value`` is, or sums, a selection on ``cond`` that writes a fill (−inf or the
    lowest value) where ``cond`` drops keys: ``Where(cond, fill, ·)`` (``fill_first``) or
    ``Where(cond, ·, fill)``, before or after :class:`SelectionMaskRule` rewrote it."""
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx") or depth == 0:
        return False
    if node.op_type == "Where" and node.inputs[0] is cond:
        return _is_fill(scalar(node.inputs[1 if fill_first else 2]))
    if node.op_type == "Add":
        return any(_selects_with(i, cond, fill_first, depth - 1) for i in node.inputs)
    return False


class ZeroMaskedProbsRule(pattern.RewriteRuleClassBase):
    """Probabilities zeroed where the scores were masked (DeBERTa's ``XSoftmax``:
    ``softmax(s.masked_fill(drop, lowest)).masked_fill(drop, 0)``) become the softmax alone::

        Where(drop, 0, Softmax(x))  →  Softmax(x)    x selects Where(drop, fill, ·) (or sums it)
        Where(keep, Softmax(x), 0)  →  Softmax(x)    x selects Where(keep, ·, fill)

    A masked key's probability is ``exp(fill − max) / Σ``, exactly 0 once its row has a visible
    key; a row with every key masked (a sample that is all padding) gets the mean of V instead
    of 0, a value no output token reads. Rejections: a written value other than 0; a condition
    that is not the one the scores were masked with (fill −inf or the dtype's lowest).
    """

    def __init__(self, fill_first: bool) -> None:
        super().__init__(f"ZeroMaskedProbs{'FillFirst' if fill_first else ''}")
        self._fill_first = fill_first

    def pattern(self, op, cond, x, zero):
        probs = op.Softmax(x, _outputs=["probs"])
        return op.Where(cond, zero, probs) if self._fill_first else op.Where(cond, probs, zero)

    def check(self, context, cond, x, zero, **_):
        result = pattern.MatchResult()
        if scalar(zero) != 0.0:
            return result.fail("the masked probabilities are not set to 0", zero)
        if not _selects_with(x, cond, self._fill_first):
            return result.fail("the scores were not masked on the same condition", cond)
        return result

    def rewrite(self, op, x, probs, **_):
        return op.Softmax(x, axis=probs.producer().attributes.get_int("axis", -1))


class StackedBiasRule(pattern.RewriteRuleClassBase):
    """Two biases added to the scores one after the other become one bias::

        Softmax(Add(Add(s, b1), b2))  →  Softmax(Add(s, Add(b1, b2)))

    (MPNet: a relative-position bias, then the padding mask), in either operand order of each
    ``Add``, so that the core rules see one bias. ``s`` must be computed from the Q·Kᵀ
    scores; neither bias may be (an activation-dependent term stays where it is). Reassociating
    changes the sum by rounding only (a fill of the lowest value absorbs either way)."""

    def __init__(self, inner_first: bool, outer_first: bool) -> None:
        super().__init__(f"StackedBias{'S' if inner_first else 'B'}{'I' if outer_first else 'O'}")
        self._inner_first, self._outer_first = inner_first, outer_first

    def pattern(self, op, s, b1, b2):
        inner = op.Add(s, b1) if self._inner_first else op.Add(b1, s)
        outer = op.Add(inner, b2) if self._outer_first else op.Add(b2, inner)
        return op.Softmax(outer, _outputs=["probs"])

    def check(self, context, s, b1, b2, **_):
        result = pattern.MatchResult()
        if not _from_scores(s):
            return result.fail("the value under the biases is not computed from Q·Kᵀ", s)
        for bias in (b1, b2):
            if _from_scores(bias):
                return result.fail("a bias is computed from the scores as well", bias)
        return result

    def rewrite(self, op, s, b1, b2, probs, **_):
        axis = probs.producer().attributes.get_int("axis", -1)
        return op.Softmax(op.Add(s, op.Add(b1, b2)), axis=axis)


class MaxShiftRule(pattern.RewriteRuleClassBase):
    """``Softmax(x − ReduceMax(x, -1, keepdims=1))`` → ``Softmax(x)``: subtracting the row max
    (MiMo-V2-Flash's layers without sinks, "for BF16/FP16 stability") does not change a
    softmax over the same axis, and every kernel subtracts it itself. Rejections: a max or a
    softmax over another axis, a max without its axis kept."""

    def pattern(self, op, x, axes):
        shifted = op.Sub(x, op.ReduceMax(x, axes, _outputs=["row_max"]))
        return op.Softmax(shifted, _outputs=["probs"])

    def check(self, context, x, axes, row_max, probs, **_):
        result = pattern.MatchResult()
        rank = len(x.shape) if x.shape is not None else None
        last = {-1, rank - 1} if rank else {-1}
        if int_list(axes) is None or len(int_list(axes)) != 1 or int_list(axes)[0] not in last:
            return result.fail("the row max is not over the last axis", row_max)
        if row_max.producer().attributes.get_int("keepdims", 1) != 1:
            return result.fail("the row max does not keep its axis", row_max)
        if probs.producer().attributes.get_int("axis", -1) not in last:
            return result.fail("the softmax is not over the row max's axis", probs)
        return result

    def rewrite(self, op, x, probs, **_):
        return op.Softmax(x, axis=probs.producer().attributes.get_int("axis", -1))


MASK_RULES = [
    MaxShiftRule.rule(),
    *(MultiplicativeMaskRule.rule(f) for f in (False, True)),
    *(ZeroMaskedProbsRule.rule(f) for f in (False, True)),
    *(SelectionMaskRule.rule(f, b) for f in (False, True) for b in ("", "right", "left")),
]
BIAS_RULES = [StackedBiasRule.rule(i, o) for i in (True, False) for o in (True, False)]
CORE_RULES = [
    *(AttentionRule.rule(b, g) for b in (True, False) for g in (True, False)),
    *(AttentionRule.rule(b, False, sink=True) for b in (True, False)),
    BatchedHeadsAttentionRule.rule(),
    BatchedScoresAttentionRule.rule(),
    *(ViewedBmmAttentionRule.rule(e, m) for e in (True, False) for m in (True, False)),
    *(BmmAttentionRule.rule(True, c, r) for c in (True, False) for r in (True, False)),
    *(BmmAttentionRule.rule(False, False, r) for r in (True, False)),
]
# Tried only where CORE_RULES left a core unfused: a view that recovers the heads
# (:class:`BmmAttentionRule`) must win over folding them into the batch.
FLAT_RULES = [AttentionRule.rule(b, g, flat=True) for b in (True, False) for g in (True, False)]
LAYOUT_RULES = [
    DoubleTransposeRule.rule(),
    SdpaKeyLayoutRule.rule(),
    RepeatKVRule.rule(),
]
