"""Rules for attention computed on (B·H, ·, ·) batches (``bmm``/``baddbmm``), the heads
folded into the batch and split again by views: BLOOM's, GPT-NeoX-Japanese's, the older
BART family's (TrOCR, XGLM, MVP, SpeechT5) and DeBERTa-v2's layouts. Each becomes
``tfgraph.Attention`` on 4-D views of Q, Kᵀ and V (:func:`_batched_heads`)."""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from tfgraph.passes.canonical import AttentionOp
from tfgraph.passes.recognize.attention.core import _rank4_static_heads
from tfgraph.passes.recognize.attention.score_masks import _is_fill
from tfgraph.passes.rewrite_utils import same_dims, scalar


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
    zeros, which :mod:`tfgraph.passes.recognize.exact_no_op` drops), the probabilities
    multiply a 4-D V::

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
