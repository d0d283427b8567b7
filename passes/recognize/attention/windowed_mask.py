"""A mask added on a reshaped view of the scores (shifted-window attention) becomes a bias on
the scores themselves, which the core rules take like any other.

Swin (HF, timm, torchvision) computes the scores of every window of every image as one batch
of rows, (B·nW, H, N, N), then views them per image to add the shift mask of each window
(nW, N, N), and views them back before the softmax::

    s ─► Reshape ─► (B, nW, H, N, N) ─► Add(·, mask) ─► Reshape ─► Softmax ─► MatMul(·, V)
                        mask: (1, nW, 1, N, N)            (B·nW, H, N, N)

A view is a relabelling of the same elements, so adding the mask to the view and viewing back
is adding, to ``s``, the mask viewed the same way::

    MatMul(Softmax(Add(s, bias)), V)    bias (B·nW, 1, N, N): row r takes window r mod nW

The bias is built from the mask alone and the row count of V (which the fused op keeps), with
the canonical op's broadcast shapes (docs/attention-lowering.md: (B, 1, T, S), (1, 1, T, S),
(B, H, T, S) are what every lowering accepts), per the mask's leading dims:

1. the same for every row (1, 1, …): the mask viewed as (1, …);
2. per window (1, nW, …): ``Gather(mask viewed (nW, …), Range(rows) mod nW)``, (B·nW, …);
3. per image and window (B, nW, …): the mask viewed as (B·nW, …).

When ``s`` is ``Add(t, b)`` with ``b`` not computed from the scores (Swin's relative position
bias), the mask joins ``b``: ``Add(t, Add(b, bias))``, so the core rules see one bias.

Rejections (``check`` reasons, reported after "mask added on a reshaped view of the scores:"):
unknown shapes; a view that does not split only the scores' first axis in two; a view back to
another shape; a mask that broadcasts the view to a larger shape, or differs per image but not
per window; a mask computed from the scores.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from tfgraph.passes.recognize.attention.score_masks import _from_scores
from tfgraph.passes.rewrite_utils import same_dims

PREFIX = "mask added on a reshaped view of the scores"


def _one(dim) -> bool:
    return isinstance(dim, int) and dim == 1


def _mask_case(mask_dims: list, view_dims: list) -> str | None:
    """``shared``, ``per_window`` or ``per_row`` (see the module docstring), from the mask's
    dims left-padded with 1s to the view's rank; None when it is none of these."""
    lead_b, lead_w = mask_dims[0], mask_dims[1]
    by_image = not _one(lead_b)
    by_window = not _one(lead_w)
    if by_image and not same_dims([lead_b], [view_dims[0]]):
        return None
    if by_window and not same_dims([lead_w], [view_dims[1]]):
        return None
    for m, w in zip(mask_dims[2:], view_dims[2:], strict=True):
        if not _one(m) and not same_dims([m], [w]):
            return None
    if by_image and not by_window:
        return None
    return {(False, False): "shared", (False, True): "per_window"}.get(
        (by_image, by_window), "per_row"
    )


class WindowedMaskRule(pattern.RewriteRuleClassBase):
    """One instance per operand order of the ``Add`` (view first or mask first)."""

    def __init__(self, mask_first: bool) -> None:
        super().__init__(f"WindowedMask{'MaskFirst' if mask_first else ''}")
        self._mask_first = mask_first

    def pattern(self, op, s, shape_in, mask, shape_out, v):
        view = op.Reshape(s, shape_in, _outputs=["view"])
        pair = (mask, view) if self._mask_first else (view, mask)
        summed = op.Add(*pair, _outputs=["summed"])
        back = op.Reshape(summed, shape_out, _outputs=["back"])
        probs = op.Softmax(back, _outputs=["probs"])
        return op.MatMul(probs, v)

    def check(self, context, s, view, summed, back, mask, v, **_):
        result = pattern.MatchResult()
        shapes = (s.shape, view.shape, summed.shape, back.shape, mask.shape, v.shape)
        if any(shape is None for shape in shapes):
            return result.fail("the shapes of the scores, their views or the mask are unknown", s)
        if not _from_scores(s):
            return result.fail("the viewed value is not computed from Q·Kᵀ scores", s)
        if _from_scores(mask):
            return result.fail("the added term is computed from the scores as well", mask)
        rank = len(s.shape)
        if len(view.shape) != rank + 1 or not same_dims(view.shape[2:], s.shape[1:]):
            return result.fail(
                f"the view {_dims(view)} of the scores {_dims(s)} does not split only their "
                "first (batch·window) axis in two",
                view,
            )
        if not same_dims(back.shape, s.shape):
            return result.fail(f"the view back {_dims(back)} is not the scores' shape", back)
        if not same_dims(summed.shape, view.shape):
            return result.fail(
                f"the mask {_dims(mask)} broadcasts the view {_dims(view)} to a larger shape", mask
            )
        if len(mask.shape) > rank + 1:
            return result.fail(f"the mask {_dims(mask)} has more axes than the view", mask)
        mask_dims = [1] * (rank + 1 - len(mask.shape)) + list(mask.shape)
        case = _mask_case(mask_dims, list(view.shape))
        if case is None:
            return result.fail(
                f"the mask {_dims(mask)} is not 1 or the view's size {_dims(view)} on each "
                "axis, or it differs per image but not per window",
                mask,
            )
        if not same_dims(v.shape[:1], s.shape[:1]):
            return result.fail("V's rows are not the scores' rows", v)
        self._case, self._rank, self._mask_dims = case, rank, mask_dims
        return result

    def rewrite(self, op, s, mask, v, probs, **_):
        i64 = ir.DataType.INT64
        missing = self._rank + 1 - len(mask.shape)
        m = mask
        if missing:  # left-pad to the view's rank, as Add broadcast it
            m = op.Unsqueeze(mask, op.Constant(value=ir.tensor(list(range(missing)), dtype=i64)))
        tail_dims = self._mask_dims[2:]
        if all(isinstance(d, int) for d in tail_dims):
            tail = op.Constant(value=ir.tensor(tail_dims, dtype=i64))
        else:
            tail = op.Shape(m, start=2)
        lead = op.Constant(value=ir.tensor([1 if self._case == "shared" else -1], dtype=i64))
        bias = op.Reshape(m, op.Concat(lead, tail, axis=0))
        rows = 1 if self._case == "shared" else s.shape[0]
        if self._case == "per_window":  # row r of the scores is window r mod nW
            count = op.Squeeze(op.Shape(v, start=0, end=1))
            windows = op.Squeeze(op.Shape(m, start=1, end=2))
            zero = op.Constant(value=ir.tensor(0, dtype=i64))
            one = op.Constant(value=ir.tensor(1, dtype=i64))
            bias = op.Gather(bias, op.Mod(op.Range(zero, count, one), windows), axis=0)
        bias.shape, bias.type = ir.Shape([rows, *tail_dims]), mask.type
        add = s.producer()
        axis = probs.producer().attributes.get_int("axis", -1)
        if add is not None and add.op_type == "Add" and add.domain in ("", "ai.onnx"):
            t, b = add.inputs
            if _from_scores(b) and not _from_scores(t):
                t, b = b, t
            if _from_scores(t) and not _from_scores(b):  # Swin's position bias: one bias
                s, combined = t, op.Add(b, bias)
                combined.shape, combined.type = _broadcast(b, bias), mask.type
                bias = combined
        scores = op.Add(s, bias)
        scores.shape, scores.type = s.shape, s.type
        return op.MatMul(op.Softmax(scores, axis=axis), v)


def _broadcast(a: ir.Value, b: ir.Value) -> ir.Shape | None:
    """The shape of ``a + b`` when both are known and of one rank, else None."""
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return None
    return ir.Shape([y if _one(x) else x for x, y in zip(a.shape, b.shape, strict=True)])


def _dims(value: ir.Value) -> str:
    return "(" + ", ".join(str(d) for d in value.shape) + ")"


def looks_windowed(softmax: ir.Node) -> bool:
    """A softmax over a view of a sum (or other elementwise op) of a view: shifted-window
    attention that :data:`RULES` may have refused; their reason says more than the core
    rules' structural one."""
    back = softmax.inputs[0].producer() if softmax.inputs[0] is not None else None
    if back is None or back.op_type != "Reshape":
        return False
    summed = back.inputs[0].producer()
    if summed is None or summed.op_type not in ("Add", "Sub", "Mul", "Where"):
        return False
    return any(
        i is not None and i.producer() is not None and i.producer().op_type == "Reshape"
        for i in summed.inputs
    )


RULES = [WindowedMaskRule.rule(f) for f in (False, True)]
