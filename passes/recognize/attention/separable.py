"""Separable self-attention (MobileViTV2's ``MobileViTV2LinearSelfAttention``) as
``tfgraph.Attention``.

MobileViTV2 projects x (B, C, P, N) (P pixels of a patch, N patches) to one logit channel
``s`` (B, 1, P, N) and values ``v`` (B, d, P, N), then pools the values over the N tokens::

    p = Softmax(s, axis=t)              s (B, 1, P, N), t = the token axis (−1)
    y = ReduceSum(Mul(v, p), axes=[t])  v (B, d, P, N) → y (B, d, P, 1)

That is attention with ONE query per (B, P) whose logits over the N keys are given directly:
``y = softmax(Q·Kᵀ)·V`` with Q = 1 (one query of head size 1), K = s (N keys of head size 1),
V = v (N values of head size d) and scale 1, since ``1·s_n = s_n``. The rule writes it on
one-head views, the other axes L folded into R rows (as :func:`.core._flat_attention`)::

    K = Reshape(Transpose(s, L + [t, a]), (R, 1, N, 1))
    V = Reshape(Transpose(v, L + [t, a]), (R, 1, N, d))       a: the value axis
    Q = Expand(1, (R, 1, 1, 1))
    y = Transpose(Reshape(tfgraph.Attention(Q, K, V, scale=1), L + [1, d]), inverse(L + [t, a]))

The value axis ``a`` is the one axis where p is 1 and v is not (the probabilities broadcast over
the value channels); every other axis has the same dims in both. One head, not P heads: the
``ort`` lowering's (B, S, H·d) layout then costs ONNX Runtime one transpose of V that moves
the token axis ahead of d (2.8 ms on (1, 128, 4, 1024) fp32, 2 CPU threads), where P heads
made it a full reversal of the last three axes (7 to 13 ms, measured, ORT 1.32). V's head size
(d) differs from Q's and K's (1): ``MultiHeadAttention`` takes that (ORT 1.32's CPU kernel:
exact to 1.2e-7), and so do ONNX ``Attention``-23 and the decomposed form.

Rejections (``check`` reasons): the sum not over the softmax's axis alone; shapes unknown or of
different ranks (or below 3); no single axis the probabilities broadcast over (or one more);
other axes that differ (broadcasting beyond the value axis); a gate's softmax over a
projection (a mixture of experts' weighted sum of expert outputs:
:func:`.gating_softmax.is_gating_softmax`), which is not attention.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from tfgraph.passes.canonical import AttentionOp
from tfgraph.passes.recognize.attention.gating_softmax import is_gating_softmax
from tfgraph.passes.rewrite_utils import int_list, same_dims

_I64 = ir.DataType.INT64


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


class SeparableAttentionRule(pattern.RewriteRuleClassBase):
    """``ReduceSum(Mul(v, Softmax(s)), [t])``; ``probs_first``: ``Mul(Softmax(s), v)``."""

    def __init__(self, probs_first: bool) -> None:
        super().__init__("SeparableAttention" + ("ProbsFirst" if probs_first else ""))
        self._probs_first = probs_first

    def pattern(self, op, scores, values, axes):
        probs = op.Softmax(scores, _outputs=["probs"])
        product = op.Mul(probs, values) if self._probs_first else op.Mul(values, probs)
        return op.ReduceSum(product, axes, _outputs=["summed"])

    def check(self, context, scores, values, axes, probs, summed, **_):
        result = pattern.MatchResult()
        if scores.shape is None or values.shape is None or scores.dtype is None:
            return result.fail("the scores' or the values' shape or type is unknown", scores)
        rank = len(scores.shape)
        if rank < 3 or len(values.shape) != rank:
            return result.fail("scores and values are not of one rank ≥ 3", values)
        softmax, reduce = probs.producer(), summed.producer()
        t = _axis(softmax.attributes.get_int("axis", -1), rank)
        reduced = int_list(axes)
        if reduced is None or [_axis(a, rank) for a in reduced] != [t]:
            return result.fail(f"the sum is not over the softmax's axis {t} alone", summed)
        if reduce.attributes.get_int("noop_with_empty_axes", 0):
            return result.fail("ReduceSum with noop_with_empty_axes", summed)
        p, v = scores.shape, values.shape
        spread = [i for i in range(rank) if i != t and p[i] == 1 and v[i] != 1]
        if len(spread) != 1:
            return result.fail(
                f"the probabilities broadcast over {len(spread)} axes of the values, not one",
                probs,
            )
        (a,) = spread
        lead = [i for i in range(rank) if i not in (a, t)]
        if not same_dims([p[i] for i in [*lead, t]], [v[i] for i in [*lead, t]]):
            return result.fail("scores and values differ outside the value axis", values)

        if is_gating_softmax(softmax):
            return result.fail("a gate's softmax over a projection (experts), not attention", probs)
        self._perm = [*lead, t, a]
        self._keepdims = bool(reduce.attributes.get_int("keepdims", 1))
        return result

    def rewrite(self, op, scores, values, summed, **_):
        perm = self._perm
        lead = [values.shape[i] for i in perm[:-2]]
        n, d = values.shape[perm[-2]], values.shape[perm[-1]]
        static = all(isinstance(dim, int) for dim in lead)
        rows = int(np.prod(lead)) if static else ir.SymbolicDim(f"{values.name}_rows")
        minus_one_one = op.Constant(value=ir.tensor([-1, 1], dtype=_I64))
        one_minus_one = op.Constant(value=ir.tensor([1, -1], dtype=_I64))

        def view(x, last):  # (…, N, c) with the token and value axes last → (R, 1, N, c)
            y = op.Transpose(x, perm=perm)
            y.shape, y.type = ir.Shape([*lead, n, last]), x.type
            y4 = op.Reshape(y, op.Concat(minus_one_one, op.Shape(y, start=-2), axis=0))
            y4.shape, y4.type = ir.Shape([rows, 1, n, last]), x.type
            return y, y4

        _, k = view(scores, 1)
        v_lead, v = view(values, d)
        ones = op.Constant(value=ir.tensor(np.ones((1, 1, 1, 1), scores.dtype.numpy())))
        q = op.Expand(
            ones,
            op.Concat(op.Shape(k, end=1), op.Constant(value=ir.tensor([1, 1, 1], _I64)), axis=0),
        )
        q.shape, q.type = ir.Shape([rows, 1, 1, 1]), scores.type
        y = AttentionOp(num_heads=1, kv_num_heads=1, scale=1.0).make(op, q, k, v)
        y.shape, y.type = ir.Shape([rows, 1, 1, d]), values.type
        y = op.Reshape(y, op.Concat(op.Shape(v_lead, end=-2), one_minus_one, axis=0))
        y.shape, y.type = ir.Shape([*lead, 1, d]), values.type  # (…, 1, d)
        out = op.Transpose(y, perm=[int(i) for i in np.argsort(perm)])  # keepdims: size 1 at t
        if not self._keepdims:
            out = op.Squeeze(out, op.Constant(value=ir.tensor([perm[-2]], dtype=_I64)))
        return out


RULES = [SeparableAttentionRule.rule(first) for first in (False, True)]
