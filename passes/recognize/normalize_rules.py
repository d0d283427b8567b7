"""Rules that recognize an L2-normalization over the last axis as a scaled ``tfgraph.RMSNorm``.

Third-party libraries write RMSNorm as ``F.normalize(x, dim=-1) * √d * γ`` (or without ``√d``,
or as ``x / x.norm(dim=-1, keepdim=True).clamp(min=ε)``). Over the last axis of size ``d``,
``‖x‖₂ = √d · √mean(x²)``, so ``x / ‖x‖₂ = RMSNorm(x) / √d``: each form becomes
``Mul(tfgraph.RMSNorm(x; ε′), 1/√d)``, and :mod:`.norm_scales` folds that constant and the
model's own (``√d``, γ) into the norm's γ.

Forms (``S = Σx²`` over the last axis; ``·²`` is ``Pow(·, 2)`` or ``Mul(·, ·)``)::

    n = ReduceL2(x) | Sqrt(ReduceSum(x²)) | Sqrt(ReduceSumSquare(x))       ε′ = 0
      | Sqrt(ReduceSum(x²) + ε) | Sqrt(ReduceSumSquare(x) + ε)             ε′ = ε/d (exact)
      | Max(n, ε) | Clip(n, ε)   (clamp_min: what F.normalize does)        ε′ = ε²/d
    y = Div(x, n) | Mul(x, Reciprocal(n)), n optionally through Expand (F.normalize's expand_as)

The ε of ``F.normalize`` is a floor on the norm, ``x / max(‖x‖, ε)``; RMSNorm adds ε under the
root, ``x / √(mean(x²) + ε′)``. No ε′ makes the two equal everywhere; ``ε′ = ε²/d`` gives
``x·√d / √(‖x‖² + ε²)``, which differs from ``x·√d / max(‖x‖, ε)`` by a relative
``1 − 1/√(1 + (ε/‖x‖)²) ≤ ½(ε/‖x‖)²`` when ``‖x‖ ≥ ε``: below fp32's rounding (6e-8) for every
row whose norm is above ~3000·ε (3e-9 with the default ε = 1e-12); an all-zero row gives 0 on
both sides (ε′ = 0 would give NaN). Only rows within a few thousand ε of zero differ, by at most
a factor √2 at ``‖x‖ = ε``.

Rejections (the ``check`` reasons): reductions not over the last axis alone, or not keeping it
(``keepdims=0``); the norm expanded to more axes than x has; a last axis without a static size
(``√d`` unknown); ε not a constant scalar; ε both added and clamped; an exponent other than 2;
x of unknown dtype.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from tfgraph.passes.canonical import RMSNormOp
from tfgraph.passes.recognize.norm_rules import check_common, square

_REDUCTIONS = ("ReduceL2", "ReduceSum", "ReduceSumSquare")
_BETWEEN = ("Expand", "Max", "Clip", "Sqrt", "Add", "Reciprocal")


def _norm(op, x, axes):
    """‖x‖₂ over ``axes``, ε optionally added under the root (``add_eps``)."""
    sum_sq = pattern.OrValue([op.ReduceSum(square(op, x, "x"), axes), op.ReduceSumSquare(x, axes)])
    under_root = pattern.OrValue([op.Add(sum_sq, pattern.Var("add_eps")), sum_sq])
    return pattern.OrValue([op.ReduceL2(x, axes), op.Sqrt(under_root)])


def _denominator(op, x, axes):
    """The norm, optionally floored at ε (``clamp_eps``) and expanded to x's shape."""
    n = _norm(op, x, axes)
    eps = pattern.Var("clamp_eps")
    clamped = pattern.OrValue([op.Max(n, eps), op.Clip(n, eps, None), n])
    return pattern.OrValue([op.Expand(clamped, pattern.Var("shape")), clamped])


def _reduction(value: ir.Value | None) -> ir.Node | None:
    """The reduction under a matched denominator (through Expand, Max, Clip, Sqrt, Add)."""
    node = value.producer() if value is not None else None
    while node is not None and node.op_type in _BETWEEN:
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    return node if node is not None and node.op_type in _REDUCTIONS else None


def last_dim(x: ir.Value) -> int | None:
    """The static size of x's last axis, else None."""
    if x.shape is None or len(x.shape) == 0:
        return None
    d = x.shape[-1]
    return d if isinstance(d, int) else None


class L2NormalizeRule(pattern.RewriteRuleClassBase):
    """``x / ‖x‖₂`` over the last axis (every form in the module docstring) →
    ``Mul(tfgraph.RMSNorm(x; ε′), 1/√d)``; one instance per final division form."""

    def __init__(self, use_div: bool) -> None:
        super().__init__(f"L2Normalize{'Div' if use_div else 'MulReciprocal'}")
        self._use_div = use_div

    @classmethod
    def rules(cls) -> list[pattern.RewriteRule]:
        return [cls.rule(True), cls.rule(False)]

    def pattern(self, op, x, axes):
        n = _denominator(op, x, axes)
        if self._use_div:
            return op.Div(x, n, _outputs=["y"])
        return op.Mul(x, op.Reciprocal(n), _outputs=["y"])

    def check(self, context, x, axes, y, add_eps=None, clamp_eps=None, x_exp=None, shape=None):
        result = pattern.MatchResult()
        if shape is not None and None not in (x.shape, y.shape) and len(y.shape) != len(x.shape):
            return result.fail("the norm is expanded beyond x's shape", shape)
        if add_eps is not None and clamp_eps is not None:
            return result.fail("ε is both added under the root and a floor on the norm", x)
        result, eps = check_common(
            result, x, add_eps if add_eps is not None else clamp_eps, [axes], [x_exp]
        )
        if not result:
            return result
        reduction = _reduction(y.producer().inputs[1])  # through Reciprocal too
        if reduction is None or not reduction.attributes.get_int("keepdims", 1):
            return result.fail("the norm does not keep the reduced axis (keepdims=0)", axes)
        d = last_dim(x)
        if d is None:
            return result.fail("the last axis has no static size, so √d is unknown", x)
        if x.dtype is None:
            return result.fail("x has no known dtype", x)
        self._d = d
        self._epsilon = eps**2 / d if clamp_eps is not None else eps / d
        return result

    def rewrite(self, op, x, **_):
        norm = RMSNormOp(self._epsilon).make(op, x)
        c = np.array(1 / math.sqrt(self._d), dtype=x.dtype.numpy())
        return op.Mul(norm, op.Constant(value=ir.tensor(c)))


class LpNormalizationRule(pattern.RewriteRuleClassBase):
    """ONNX's ``LpNormalization``: counted as a norm, never rewritten (it has no ε, so its
    zero rows are the runtime's choice); its only purpose is the reason the report shows."""

    REASON = "LpNormalization has no ε (its zero rows are the runtime's choice): left as is"

    def __init__(self) -> None:
        super().__init__(remove_nodes=False)

    def pattern(self, op, x):
        return op.LpNormalization(x)

    def check(self, context, x, **_) -> pattern.MatchResult:
        return pattern.MatchResult().fail(self.REASON, x)

    def rewrite(self, op, **_):  # pragma: no cover - check() always fails
        raise AssertionError("LpNormalization is never rewritten")


RULES = L2NormalizeRule.rules()
DIAGNOSTIC_RULES = [*RULES, LpNormalizationRule.rule()]
