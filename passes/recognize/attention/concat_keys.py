"""Keys joined inside the softmax, split after it: one attention over the concatenated keys.

PEGASUS-X's block-local attention (``compute_local_attention_representations``) scores each
block's queries against the global tokens' keys and against its own block's keys, joins the
two score sets for one softmax, and splits the probabilities again for the two value sets::

    s = Concat(MatMul(Q, Kᵀa), MatMul(Q, Kᵀb), axis=-1) [+ mask]      (…, T, Sa + Sb)
    p = Softmax(s, -1)
    y = MatMul(Slice(p, [0, Sa)), Va) + MatMul(Slice(p, [Sa, end)), Vb)

is ``softmax(Q·[Ka; Kb]ᵀ + mask)·[Va; Vb]``: one attention whose keys and values are the
concatenations (in either operand order of the final ``Add``)::

    MatMul(Softmax(MatMul(Q, Concat(Kᵀa, Kᵀb, axis=-1)) [+ mask]), Concat(Va, Vb, axis=-2))

which the core rules of :mod:`.rules` then fuse (PEGASUS-X's blocks are 5-D
(B, H, blocks, block, d): the flat rules, one-head views). A key set shared by every block
(the global keys, (B, H, 1, ·, ·) once :mod:`.einsum_rules` broadcasts them) is expanded to
Q's leading dims first. Rejections: a concatenation or a softmax not over the last axis;
slices that do not split the probabilities at ``Sa`` along the last axis with step 1;
operands of other ranks than Q's, or leading dims neither Q's nor 1.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from tfgraph.passes.rewrite_utils import int_list, same_dims

_END = 2**31 - 1  # an end at or past this is "to the end" (torch writes INT64_MAX)


def _last_axis(axis: int | None, rank: int) -> bool:
    return axis in (-1, rank - 1)


class ConcatKeysRule(pattern.RewriteRuleClassBase):
    """The module doc's form; ``masked``: an ``Add`` of a mask after the ``Concat``."""

    def __init__(self, masked: bool) -> None:
        super().__init__(f"ConcatKeys{'Masked' if masked else ''}")
        self._masked = masked

    def pattern(self, op, q, kta, ktb, mask, v1, v2):
        scores = op.Concat(op.MatMul(q, kta), op.MatMul(q, ktb), _outputs=["joined"])
        if self._masked:
            scores = op.Add(scores, mask)
        probs = op.Softmax(scores, _outputs=["probs"])
        p1 = op.Slice(probs, _allow_other_inputs=True, _outputs=["p1"])
        p2 = op.Slice(probs, _allow_other_inputs=True, _outputs=["p2"])
        return op.Add(op.MatMul(p1, v1), op.MatMul(p2, v2))

    def check(self, context, q, kta, ktb, v1, v2, joined, probs, p1, p2, **kw):
        result = pattern.MatchResult()
        values = (q, kta, ktb, v1, v2, joined)
        if any(v.shape is None for v in values):
            return result.fail("an operand's shape is unknown", q)
        rank = len(q.shape)
        if rank < 3 or any(len(v.shape) != rank for v in values):
            return result.fail("Q, the keys, the values and the scores differ in rank", q)
        if not _last_axis(joined.producer().attributes.get_int("axis", 0), rank):
            return result.fail("the scores are not concatenated along the key axis", joined)
        if not _last_axis(probs.producer().attributes.get_int("axis", -1), rank):
            return result.fail("softmax is not over the key axis", probs)
        width = kta.shape[-1]
        spans = [_span(p, rank, joined.shape[-1]) for p in (p1, p2)]
        if spans[0] is None or spans[1] is None:
            return result.fail("the probabilities are not sliced along the key axis", p1)
        if spans == [(width, None), (0, width)]:
            self._order = (1, 0)  # the Add takes the slice of Kb first
        elif spans == [(0, width), (width, None)]:
            self._order = (0, 1)
        else:
            return result.fail(f"the slices do not split the probabilities at {width}", p1)
        lead = q.shape[:-2]
        for value in (kta, ktb, v1, v2):
            dims = value.shape[:-2]
            if not all(d == 1 or same_dims([d], [e]) for d, e in zip(dims, lead, strict=True)):
                return result.fail("a key or value set's leading dims are neither Q's nor 1", value)
        self._heads = None
        if rank > 4:
            self._heads = _head_axis(q, kw.get("mask"))
            if self._heads is None:
                return result.fail(
                    "no static head axis among Q's leading dims that the mask does not vary "
                    "along, with the mask's other leading dims Q's",
                    q,
                )
        return result

    def rewrite(self, op, q, kta, ktb, v1, v2, joined, mask=None, **_):
        lead, total = list(q.shape[:-2]), joined.shape[-1]

        def full(x):  # x broadcast to Q's leading dims
            if same_dims(x.shape[:-2], lead):
                return x
            shape = op.Concat(op.Shape(q, end=-2), op.Shape(x, start=-2), axis=0)
            y = op.Expand(x, shape)
            y.shape, y.type = ir.Shape([*lead, *x.shape[-2:]]), x.type
            return y

        va, vb = (v1, v2) if self._order == (0, 1) else (v2, v1)
        kt = op.Concat(full(kta), full(ktb), axis=-1)
        kt.shape, kt.type = ir.Shape([*lead, kta.shape[-2], total]), kta.type
        v = op.Concat(full(va), full(vb), axis=-2)
        v.shape, v.type = ir.Shape([*lead, total, va.shape[-1]]), va.type
        if self._heads is None:  # 3-D or 4-D: the core rules take it as it is
            return _attention(op, q, kt, v, mask, ir.Shape([*lead, q.shape[-2], total]))
        return _with_heads(op, q, kt, v, mask, self._heads, total)


def _head_axis(q: ir.Value, mask: ir.Value | None) -> int | None:
    """The axis of Q's leading dims (not the first) to keep as heads when the others merge
    into one batch: a static one the mask does not vary along; the mask's other leading dims
    must be Q's (merged alike). None when there is none."""
    rank = len(q.shape)
    dims = None
    if mask is not None:
        if mask.shape is None or len(mask.shape) > rank:
            return None
        dims = [1] * (rank - len(mask.shape)) + list(mask.shape)
    for axis in range(1, rank - 2):
        if not isinstance(q.shape[axis], int):
            continue
        if dims is None:
            return axis
        others = [i for i in range(rank - 2) if i != axis]
        if dims[axis] == 1 and all(same_dims([dims[i]], [q.shape[i]]) for i in others):
            return axis
    return None


def _attention(op, q, kt, v, mask, shape: ir.Shape):
    """``MatMul(Softmax(MatMul(q, kt) [+ mask]), v)``, the form the core rules take."""
    scores = op.MatMul(q, kt)
    scores.shape, scores.type = shape, q.type
    if mask is not None:
        scores = op.Add(scores, mask)
        scores.shape, scores.type = shape, q.type
    probs = op.Softmax(scores, axis=-1)
    probs.shape, probs.type = shape, q.type
    return op.MatMul(probs, v)


def _with_heads(op, q, kt, v, mask, heads: int, total):
    """The attention on 4-D views (N, H, ·, ·): Q, Kᵀ, V and the mask with the head axis moved
    next to the matrix axes and the other leading axes merged into N (PEGASUS-X: (B, H, blocks,
    ·, ·) → (B·blocks, H, ·, ·); the mask (B, 1, blocks, 1, S) → (B·blocks, 1, 1, S), not
    expanded); the result is viewed and transposed back."""
    rank = len(q.shape)
    perm = [i for i in range(rank - 2) if i != heads] + [heads, rank - 2, rank - 1]
    back = [perm.index(i) for i in range(rank)]
    lead = [q.shape[i] for i in perm[:-3]]
    rows = int(np.prod(lead)) if all(isinstance(d, int) for d in lead) else None
    rows = rows if rows is not None else ir.SymbolicDim(f"{q.name}_rows")
    minus_one = op.Constant(value=ir.tensor([-1], dtype=ir.DataType.INT64))

    def moved(x):
        if perm == sorted(perm):
            return x
        y = op.Transpose(x, perm=perm)
        y.shape, y.type = ir.Shape([x.shape[i] for i in perm]), x.type
        return y

    def view(x):  # (…, H, a, b) → (N, H, a, b)
        y = op.Reshape(x, op.Concat(minus_one, op.Shape(x, start=-3), axis=0))
        y.shape, y.type = ir.Shape([rows, *x.shape[-3:]]), x.type
        return y

    q5 = moved(q)
    t, h = q.shape[-2], q.shape[heads]
    if mask is not None:
        if len(mask.shape) < rank:
            count = rank - len(mask.shape)
            axes = op.Constant(value=ir.tensor(list(range(count)), dtype=ir.DataType.INT64))
            grown = op.Unsqueeze(mask, axes)
            grown.shape, grown.type = ir.Shape([1] * count + list(mask.shape)), mask.type
            mask = grown
        mask = view(moved(mask))
    q4, kt4, v4 = view(q5), view(moved(kt)), view(moved(v))
    y4 = _attention(op, q4, kt4, v4, mask, ir.Shape([rows, h, t, total]))
    y4.shape, y4.type = ir.Shape([rows, h, t, v.shape[-1]]), q.type
    y5 = op.Reshape(y4, op.Concat(op.Shape(q5, end=-1), op.Shape(v, start=-1), axis=0))
    y5.shape, y5.type = ir.Shape([*q5.shape[:-1], v.shape[-1]]), q.type
    if perm == sorted(perm):
        return y5
    return op.Transpose(y5, perm=back)


def _span(sliced: ir.Value, rank: int, total) -> tuple[int, int | None] | None:
    """``(start, end)`` of a slice along the last axis (of size ``total``) with step 1
    (``end`` None: to the end), else None."""
    node = sliced.producer()
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    starts, ends = int_list(inputs[1]), int_list(inputs[2])
    axes = int_list(inputs[3]) if inputs[3] is not None else [0]
    steps = int_list(inputs[4]) if inputs[4] is not None else [1]
    if starts is None or ends is None or axes is None or steps is None:
        return None
    if len(starts) != 1 or len(ends) != 1 or len(axes) != 1 or steps != [1]:
        return None
    if not _last_axis(axes[0], rank) or starts[0] < 0:
        return None
    to_end = ends[0] >= _END or (isinstance(total, int) and ends[0] == total)
    return starts[0], (None if to_end else ends[0])


CONCAT_KEYS_RULES = [ConcatKeysRule.rule(m) for m in (True, False)]
