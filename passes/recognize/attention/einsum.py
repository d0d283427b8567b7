"""Attention written with ``torch.einsum`` (CvT, some vision and research models): the two
contractions around a softmax become ``MatMul`` so that the core rules of
:mod:`.rules` see the layout they know::

    Einsum("bhlk,bhtk->bhlt", q, k)  →  MatMul(q, Transpose(k, (0, 1, 3, 2)))
    Einsum("bhlt,bhtv->bhlv", p, v)  →  MatMul(p, v)

1. For any ``y = Einsum(eq, a, b)`` whose equation is a batched matrix product (batch letters
   in both operands and the output, in one order in all three; one free letter of each operand;
   one contracted letter; ``...`` written out from the operands' ranks: LongT5's
   ``"...qhd,...khd->...hqk"``), and which is next to a softmax (its output reaches a
   ``Softmax`` through at most three elementwise ops, or one operand is a ``Softmax``'s
   output), ``y`` becomes ``MatMul(a', b')`` with ``a'`` = a transposed to (batch…, m, k),
   ``b'`` to (batch…, k, n), and the product transposed to the output's order where it
   differs.

2. An operand without some of the batch letters (PEGASUS-X's local-to-global scores
   ``"BHNKF,BHGF->BHNKG"``: the global keys shared by every block ``N``) is unsqueezed first,
   a size-1 axis per missing letter, so ``MatMul`` broadcasts it over them
   (:func:`broadcast_batched_matmul`). Scores reach the softmax through a ``Concat`` too, and
   probabilities may be a ``Slice`` of its output (keys concatenated before the softmax and
   split after it: :mod:`.concat_keys_rules`).

Other einsums (a contraction over several letters, Shaw's relative terms:
:mod:`.gather_after_contraction`) are left alone.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

_ELEMENTWISE = frozenset({"Mul", "Div", "Add", "Sub", "Where", "Cast"})


def _expanded(equation: str, ranks: tuple[int, int] | None) -> str | None:
    """``equation`` with ``...`` written out as letters of its own (ranks of the operands
    needed; both operands must cover the same ``...`` axes), else the equation unchanged."""
    if "..." not in equation:
        return equation
    if ranks is None:
        return None
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    counts = {r - (len(t) - 3) for t, r in zip(terms, ranks, strict=True) if "..." in t}
    if len(counts) != 1 or not all("..." in t for t in (*terms, out)):
        return None
    (count,) = counts
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation][:count]
    if count < 0 or len(free) < count:
        return None
    letters = "".join(free)
    return equation.replace("...", letters)


def parse_batched_matmul(
    equation: str, ranks: tuple[int, int] | None = None
) -> tuple[list[int], list[int], list[int]] | None:
    """``(perm_a, perm_b, perm_out)`` when ``equation`` is a batched matrix product: the
    letters of both operands and the output are batch letters (in all three), one free letter
    of ``a`` and one of ``b`` (in the output), and one contracted letter (in both operands, not
    the output), each once per term, in any order. ``a`` transposed by ``perm_a`` is
    (batch…, m, k), ``b`` by ``perm_b`` (batch…, k, n) with the batch letters in the output's
    order, and ``MatMul`` of the two transposed by ``perm_out`` is the output. ``...`` needs
    ``ranks``, the operands' ranks. Else None."""
    parsed = _two_terms(equation, ranks)
    if parsed is None:
        return None
    a, b, out = parsed
    if any(len(set(t)) != len(t) for t in (a, b, out)) or len(a) != len(b) or len(a) < 3:
        return None
    batch = [c for c in out if c in a and c in b]
    free_a = [c for c in a if c not in b]
    free_b = [c for c in b if c not in a]
    contracted = [c for c in a if c in b and c not in out]
    if len(free_a) != 1 or len(free_b) != 1 or len(contracted) != 1:
        return None
    (m,), (n,), (k,) = free_a, free_b, contracted
    if [c for c in a if c in batch] != batch or [c for c in b if c in batch] != batch:
        return None  # batch axes reordered between the terms (Shaw's "bhud,uvhd->bhuv")
    if m not in out or n not in out or len(out) != len(batch) + 2 or len(a) != len(batch) + 2:
        return None
    product = [*batch, m, n]
    return (
        [a.index(c) for c in (*batch, m, k)],
        [b.index(c) for c in (*batch, k, n)],
        [product.index(c) for c in out],
    )


def _two_terms(equation: str, ranks) -> tuple[str, str, str] | None:
    """``(a, b, out)`` of a two-operand equation with ``...`` expanded; None otherwise."""
    if "->" not in equation:
        return None
    equation = _expanded(equation.replace(" ", ""), ranks)
    if equation is None:
        return None
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    return (terms[0], terms[1], out) if len(terms) == 2 else None


def broadcast_batched_matmul(
    equation: str, ranks: tuple[int, int] | None = None
) -> tuple[list[int], list[int], tuple[list[int], list[int], list[int]]] | None:
    """``(axes_a, axes_b, layout)`` when ``equation`` is a batched matrix product once the
    batch letters one operand lacks are inserted into it as size-1 axes (``Unsqueeze`` at
    ``axes_a`` of ``a``, ``axes_b`` of ``b``), each right after the batch letter before it in
    the output; ``layout`` as :func:`parse_batched_matmul` gives it for the completed
    equation. An operand's letters shared with the output and not with the other operand are
    its free letter (the last of them in the output) and the other's missing batch letters,
    which must come before the free letter in the operand. None when no letter is missing or
    the completed equation is no batched matrix product."""
    parsed = _two_terms(equation, ranks)
    if parsed is None:
        return None
    a, b, out = parsed

    def missing_from_other(x: str, y: str) -> list[str] | None:
        only = [c for c in out if c in x and c not in y]
        if not only:
            return None
        *batch, free = only
        if any(x.index(c) > x.index(free) for c in batch):
            return None
        return batch

    def completed(term: str, missing: list[str]) -> tuple[str, list[int]]:
        for letter in missing:  # after the output's batch letter before it, if term has it
            before = [c for c in out[: out.index(letter)] if c in term]
            at = term.index(before[-1]) + 1 if before else 0
            term = term[:at] + letter + term[at:]
        return term, [term.index(c) for c in missing]

    add_b, add_a = missing_from_other(a, b), missing_from_other(b, a)
    if add_a is None or add_b is None or not (add_a or add_b):
        return None
    (a, axes_a), (b, axes_b) = completed(a, add_a), completed(b, add_b)
    layout = parse_batched_matmul(f"{a},{b}->{out}")
    return None if layout is None else (sorted(axes_a), sorted(axes_b), layout)


def _near_softmax(y: ir.Value, operands: tuple[ir.Value, ...]) -> bool:
    for o in operands:  # probabilities: a softmax's output, or a slice of it
        node = o.producer()
        if node is not None and node.op_type == "Slice" and node.inputs[0] is not None:
            node = node.inputs[0].producer()
        if node is not None and node.op_type == "Softmax":
            return True
    frontier = [y]
    for _ in range(4):
        users = [u.node for v in frontier for u in v.uses()]
        if any(n.op_type == "Softmax" for n in users):
            return True
        frontier = [n.outputs[0] for n in users if n.op_type in _ELEMENTWISE or _last_concat(n)]
    return False


def _gathered(value: ir.Value) -> bool:
    """Rows looked up in a table (BERT's relative-key distance embeddings): ``Gather``."""
    node = value.producer()
    return node is not None and node.op_type == "Gather"


def _last_concat(node: ir.Node) -> bool:
    """A ``Concat`` along the last axis: scores of several key sets joined for one softmax."""
    if node.op_type != "Concat":
        return False
    rank = len(node.outputs[0].shape) if node.outputs[0].shape is not None else None
    return node.attributes.get_int("axis", 0) in (-1, rank - 1 if rank else -1)


class EinsumMatMulRule(pattern.RewriteRuleClassBase):
    """Cases 1 and 2 of the module doc. Rejections: an equation that is not a batched matrix
    product; an einsum that is not next to a softmax."""

    def pattern(self, op, a, b):
        return op.Einsum(a, b, _outputs=["y"])

    def check(self, context, a, b, y, **_):
        result = pattern.MatchResult()
        equation = y.producer().attributes.get_string("equation", "")
        ranks = None
        if a.shape is not None and b.shape is not None:
            ranks = (len(a.shape), len(b.shape))
        layout, self._missing = parse_batched_matmul(equation, ranks), ([], [])
        broadcast = broadcast_batched_matmul(equation, ranks) if layout is None else None
        if broadcast is not None and any(_gathered(o) for o in (a, b)):
            return result.fail(
                f"the einsum {equation!r} reads rows gathered from a table (a relative-position "
                "term): left to gather_after_contraction",
                y,
            )
        if broadcast is not None:
            *self._missing, layout = broadcast
        if layout is None:
            return result.fail(f"the einsum {equation!r} is not a batched matrix product", y)
        if not _near_softmax(y, (a, b)):
            return result.fail("the einsum is not next to a softmax", y)
        self._layout = layout
        return result

    def rewrite(self, op, a, b, y, **_):
        perm_a, perm_b, perm_out = self._layout
        operands = []
        for value, perm, missing in zip((a, b), (perm_a, perm_b), self._missing, strict=True):
            if missing:  # batch letters this operand lacks: size-1 axes, broadcast
                axes = op.Constant(value=ir.tensor(missing, dtype=ir.DataType.INT64))
                grown = op.Unsqueeze(value, axes)
                if value.shape is not None:
                    dims = list(value.shape)
                    for axis in missing:
                        dims.insert(axis, 1)
                    grown.shape = ir.Shape(dims)
                grown.type = value.type
                value = grown
            if perm != sorted(perm):
                moved = op.Transpose(value, perm=perm)
                if value.shape is not None:
                    moved.shape = ir.Shape([value.shape[i] for i in perm])
                moved.type = value.type
                value = moved
            operands.append(value)
        product = op.MatMul(*operands)
        if perm_out == sorted(perm_out):
            return product
        return op.Transpose(product, perm=perm_out)


EINSUM_RULES = [EinsumMatMulRule.rule()]
