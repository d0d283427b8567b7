"""Rules that bring masked or biased scores to the one additive bias the core rules take:
a selection (``masked_fill``/``where``) or a 0/1 multiplicative mask becomes an additive one,
probabilities zeroed again on the mask's condition lose the zeroing, two stacked biases
become one, and a row-max shift before the softmax is dropped."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from tfgraph.passes.rewrite_utils import constant, int_list, scalar

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
