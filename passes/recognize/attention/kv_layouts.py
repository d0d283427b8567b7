"""Layout rules around a fused ``tfgraph.Attention``: transposes of K that cancel (a double
transpose, SDPA's transpose of K through a 3-D view) and ``repeat_kv`` absorbed into
``kv_num_heads``.

Rejections: SDPA's reshapes of K not exactly the merge of (B, H) and its split back; a
``repeat_kv`` whose final reshape does not merge exactly the repeat axis into the heads,
keeping S and d.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from tfgraph.passes.canonical import DOMAIN, AttentionOp
from tfgraph.passes.rewrite_utils import int_list


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
