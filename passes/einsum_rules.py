"""Attention written with ``torch.einsum`` (CvT, some vision and research models): the two
contractions around a softmax become ``MatMul`` so that the core rules of
:mod:`.attention_rules` see the layout they know::

    Einsum("bhlk,bhtk->bhlt", q, k)  →  MatMul(q, Transpose(k, (0, 1, 3, 2)))
    Einsum("bhlt,bhtv->bhlv", p, v)  →  MatMul(p, v)

1. For any ``y = Einsum(eq, a, b)`` whose equation is a batched matrix product (both operands
   and the output of one rank r ≥ 3, the same r − 2 batch letters leading all three in the same
   order, one contracted letter in the last two of each operand, and the output ending in the
   free letter of ``a`` then that of ``b``), and which is next to a softmax (its output reaches
   a ``Softmax`` through at most three elementwise ops, or one operand is a ``Softmax``'s
   output), ``y`` becomes ``MatMul(a', b')`` with ``a'``/``b'`` transposed on their last two
   axes where the contracted letter is not last in ``a`` / first of the two in ``b``.

Other einsums (a contraction over several letters, a permuted output, a broadcast operand,
Shaw's relative terms: :mod:`.gather_after_contraction`) are left alone.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

_ELEMENTWISE = frozenset({"Mul", "Div", "Add", "Sub", "Where", "Cast"})


def parse_batched_matmul(equation: str) -> tuple[bool, bool] | None:
    """``(transpose_a, transpose_b)`` when ``equation`` is a batched matrix product (case 1
    of the module doc), else None."""
    if "..." in equation or "->" not in equation:
        return None
    lhs, out = equation.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != 2:
        return None
    a, b = terms
    r = len(out)
    if r < 3 or len(a) != r or len(b) != r or any(len(set(t)) != r for t in (a, b, out)):
        return None
    batch, m, n = out[:-2], out[-2], out[-1]
    if a[:-2] != batch or b[:-2] != batch:
        return None
    ka, kb = set(a[-2:]) - {m}, set(b[-2:]) - {n}
    if m not in a[-2:] or n not in b[-2:] or len(ka) != 1 or ka != kb or ka & set(out):
        return None
    (k,) = ka
    return a[-1] != k, b[-2] != k


def _near_softmax(y: ir.Value, operands: tuple[ir.Value, ...]) -> bool:
    if any(o.producer() is not None and o.producer().op_type == "Softmax" for o in operands):
        return True
    frontier = [y]
    for _ in range(4):
        users = [u.node for v in frontier for u in v.uses()]
        if any(n.op_type == "Softmax" for n in users):
            return True
        frontier = [n.outputs[0] for n in users if n.op_type in _ELEMENTWISE]
    return False


class EinsumMatMulRule(pattern.RewriteRuleClassBase):
    """Case 1 of the module doc. Rejections: an equation that is not a batched matrix
    product; an einsum that is not next to a softmax."""

    def pattern(self, op, a, b):
        return op.Einsum(a, b, _outputs=["y"])

    def check(self, context, a, b, y, **_):
        result = pattern.MatchResult()
        equation = y.producer().attributes.get_string("equation", "")
        layout = parse_batched_matmul(equation)
        if layout is None:
            return result.fail(f"the einsum {equation!r} is not a batched matrix product", y)
        if not _near_softmax(y, (a, b)):
            return result.fail("the einsum is not next to a softmax", y)
        self._layout, self._rank = layout, len(equation.split("->")[1].strip())
        return result

    def rewrite(self, op, a, b, y, **_):
        swapped = []
        for value, transpose in zip((a, b), self._layout, strict=True):
            if transpose:
                perm = [*range(self._rank - 2), self._rank - 1, self._rank - 2]
                t = op.Transpose(value, perm=perm)
                if value.shape is not None:
                    t.shape = ir.Shape([*value.shape[:-2], value.shape[-1], value.shape[-2]])
                t.type = value.type
                value = t
            swapped.append(value)
        return op.MatMul(*swapped)


EINSUM_RULES = [EinsumMatMulRule.rule()]
