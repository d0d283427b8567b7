"""Rules recognizing hand-written GELU as the canonical ``tfgraph.Gelu(x, approximate=...)``.

``GELU(x) = x·Φ(x)`` is written out in two ways:

- erf (exact, ``approximate="none"``): ``0.5 · x · (1 + erf(x / √2))``;
- tanh (``approximate="tanh"``): ``0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`` as
  GPT-2's ``gelu_new`` writes it, or ``0.5 · x · (1 + tanh(√(2/π) · x · (1 + 0.044715 · x²)))``
  as BLOOM and Megatron write it.

Both rules share the outer product ``0.5 · x · (1 + f)`` in its three groupings and accept every
``Add``/``Mul`` in either operand order. Constants are matched as *any* scalar constant and bound
by name, so that ``check`` can name the one that differs when a near-GELU is left alone.
The backend op is chosen later, by ``LowerGeluPass``.

Operand order is spelled out with ``OrValue`` alternatives (:func:`_either`) rather than
``RewriteRuleSet(commute=True)``: commuting every ``Add``/``Mul`` of these patterns makes 8,256
rule variants, which took 7.5 s on the 125 nodes of ``bert-tiny`` (these six rules: 5 ms).
Alternatives are tried in order and the first that matches is kept, with no backtracking, which
is exact only if a wrong alternative cannot match: so an operand pair never is two bare
variables (one side is a sub-pattern or a scalar constant, and ``x``, an activation, is never a
constant), and ``x`` alone is tried only where it is already bound or is the whole operand. The
root ``Mul`` cannot be an alternative, so each rule comes in three instances, by the root's left
operand: the ``1 + f`` side, ``x·0.5`` or ``0.5``, or ``x`` itself (as onnxscript's
``RmsNormFusion`` comes in two, by its root's operand order).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter.pattern import (
    Constant,
    MatchResult,
    OrValue,
    RewriteRule,
    RewriteRuleClassBase,
    RewriteRuleSet,
)

from tfgraph.passes.canonical import GeluOp
from tfgraph.passes.rewrite_utils import scalar

HALF = 0.5
SQRT_2 = math.sqrt(2.0)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)  # 0.7978845608...
CUBIC = 0.044715
# Relative tolerance on the constants: 1e-6 (BLOOM writes √(2/π) as 0.79788456), or the
# rounding of the constant's own type where that is coarser.
REL_TOL = 1e-6
REL_TOL_OF_TYPE = {ir.DataType.FLOAT16: 2.0**-10, ir.DataType.BFLOAT16: 2.0**-7}

FLOAT_TYPES = frozenset(
    {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}
)

# The operands of the root Mul of 0.5 · x · y (y = 1 + f), as their alternatives are tagged, in
# the pairs that make the product: (x·0.5)·y, x·(y·0.5), (x·y)·0.5.
GROUPINGS = frozenset({("y", "x·0.5"), ("y·0.5", "x"), ("x·y", "0.5")})
# The root's left operand, one rule instance each: the 1 + f side, a side with the 0.5, x.
Y_LEFT, HALF_LEFT, X_LEFT = "y", "x·0.5 or 0.5", "x"
LEFT_OPERANDS = (Y_LEFT, HALF_LEFT, X_LEFT)


class _AnyScalar(Constant):
    """Any scalar constant, bound to ``name`` like a variable so that ``check`` can judge it.

    A plain variable would also match ``x``, and an operand-order alternative could then take
    ``x`` for the constant. Matches 0-d initializers and ``Constant`` nodes (what exporters
    write), not 1-element tensors of rank 1. The name is set on onnxscript's ``ValuePattern``
    (``_name``), which ``Constant`` leaves unnamed.
    """

    def __init__(self, name: str) -> None:
        super().__init__(0.0, rel_tol=math.inf)  # every finite value is "close"
        self._name = name

    def clone(self, node_map) -> _AnyScalar:
        return _AnyScalar(self._name)


def _either(op_fn, a, b):
    """``op(a, b)`` or ``op(b, a)``; ``a`` and ``b`` must not both be bare variables."""
    return OrValue([op_fn(a, b), op_fn(b, a)])


def _gelu_product(op, x, f, left: str):
    """``0.5 · x · (1 + f)`` grouped as ``(x·0.5)·y``, ``x·(y·0.5)`` or ``(x·y)·0.5``.

    The root's other operand is tried as ``x`` alone only where that cannot go wrong: after the
    ``1 + f`` side has bound ``x``, or in the instance whose left operand is ``x`` itself.
    """
    half = _AnyScalar("half")
    y = _either(op.Add, f, _AnyScalar("one"))
    y_sides = {"y": y, "y·0.5": _either(op.Mul, y, half), "x·y": _either(op.Mul, x, y)}
    other_sides = {"x·0.5": _either(op.Mul, x, half), "0.5": half, "x": x}  # x last
    if left == X_LEFT:
        other_sides = {"x": x}
    elif left == HALF_LEFT:
        del other_sides["x"]
    y_side, other_side = _tagged(y_sides, "y_side"), _tagged(other_sides, "other_side")
    return op.Mul(y_side, other_side) if left == Y_LEFT else op.Mul(other_side, y_side)


def _tagged(alternatives: dict, tag_var: str):
    """An ``OrValue`` of the alternatives that binds ``tag_var`` to the key of the one matched."""
    return OrValue(list(alternatives.values()), tag_var=tag_var, tag_values=list(alternatives))


class _GeluFusion(RewriteRuleClassBase):
    """What both forms share: the outer product, the input type, the constants' check."""

    approximate: str

    def __init__(self, left: str) -> None:
        super().__init__(name=f"{type(self).__name__}[{left} · …]")
        self._left = left

    def _check_product(self, x: ir.Value, half, one, y_side: str, other_side: str) -> MatchResult:
        result = MatchResult()
        if x.dtype is not None and x.dtype not in FLOAT_TYPES:
            return result.fail(f"x is {x.dtype}, Gelu takes float types only", x)
        if (y_side, other_side) not in GROUPINGS:
            return result.fail(
                f"the product is ({y_side})·({other_side}), not 0.5 · x · y with y = 1 + f", x
            )
        return _expect(result, half, "the factor 0.5", HALF) and _expect(
            result, one, "the 1 of (1 + f)", 1.0
        )

    def rewrite(self, op, x, **_):
        return GeluOp(self.approximate).make(op, x)


def _expect(result: MatchResult, value: ir.Value, what: str, expected: float) -> MatchResult:
    """``result``, failed with a reason naming ``what`` unless ``value`` is ``expected``.

    ``value`` was bound by an :class:`_AnyScalar`, so it is a scalar constant.
    """
    got = scalar(value)
    if not math.isclose(got, expected, rel_tol=REL_TOL_OF_TYPE.get(value.dtype, REL_TOL)):
        shown = str(np.dtype(value.dtype.numpy()).type(got))  # float32 0.05 shows as 0.05
        return result.fail(f"{what} is {shown}, expected {expected:.9g}", value)
    return result


class GeluErfFusion(_GeluFusion):
    """``0.5 · x · (1 + erf(x / √2))`` → ``tfgraph.Gelu(x, approximate="none")``.

    1. The argument of ``erf`` is ``x / √2`` (``Div``) or ``x · (1/√2)`` (``Mul``).
    2. The product is grouped as ``(x·0.5)·y``, ``x·(y·0.5)`` or ``(x·y)·0.5``, with
       ``y = erf(…) + 1``; every ``Add``/``Mul`` in either operand order.

    ::

        x ─┬─ Div(√2) | Mul(1/√2) ── Erf ── Add(1) ──┐
           └─ Mul(0.5) ─────────────────────────── Mul ── GELU(x)      (grouping (x·0.5)·y)
    """

    approximate = "none"

    def pattern(self, op, x):
        scaled = OrValue(
            [op.Div(x, _AnyScalar("sqrt_2")), _either(op.Mul, x, _AnyScalar("inv_sqrt_2"))]
        )
        return _gelu_product(op, x, op.Erf(scaled), self._left)

    def check(self, context, x, one, y_side, other_side, half=None, **scalars):
        result = self._check_product(x, half, one, y_side, other_side)
        if not result:
            return result
        if "sqrt_2" in scalars:
            return _expect(result, scalars["sqrt_2"], "the divisor √2 in erf(x / √2)", SQRT_2)
        return _expect(
            result, scalars["inv_sqrt_2"], "the factor 1/√2 in erf(x · 1/√2)", 1 / SQRT_2
        )


class GeluTanhFusion(_GeluFusion):
    """The tanh approximation → ``tfgraph.Gelu(x, approximate="tanh")``.

    1. GPT-2 ``gelu_new``: ``0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))``, the cube as
       ``Pow(x, 3)``.
    2. BLOOM, Megatron: ``0.5 · x · (1 + tanh(√(2/π) · x · (1 + 0.044715 · x · x)))``.
    3. The product is grouped as ``(x·0.5)·y``, ``x·(y·0.5)`` or ``(x·y)·0.5``, with
       ``y = tanh(…) + 1``; every ``Add``/``Mul`` in either operand order.

    ::

        1.  x ─┬─ Pow(3) ── Mul(0.044715) ── Add ── Mul(√(2/π)) ── Tanh ── Add(1) ──┐
               ├──────────────────────────────┘                                     │
               └─ Mul(0.5) ──────────────────────────────────────────────────────── Mul ──

        2.  x ─┬─ Mul(0.044715) ── Mul(x) ── Add(1) ──┐
               ├─ Mul(√(2/π)) ─────────────────────── Mul ── Tanh ── Add(1) ──┐
               └─ Mul(0.5) ────────────────────────────────────────────────── Mul ──
    """

    approximate = "tanh"

    def pattern(self, op, x):
        sqrt_2_pi, cubic = _AnyScalar("sqrt_2_pi"), _AnyScalar("cubic")
        gpt2 = _either(
            op.Mul,
            _either(op.Add, x, _either(op.Mul, op.Pow(x, _AnyScalar("power")), cubic)),
            sqrt_2_pi,
        )
        x_squared_term = _either(op.Mul, _either(op.Mul, x, cubic), x)
        bloom = _either(
            op.Mul,
            _either(op.Mul, x, sqrt_2_pi),
            _either(op.Add, x_squared_term, _AnyScalar("one_inner")),
        )
        inner = OrValue([gpt2, bloom])
        return _gelu_product(op, x, op.Tanh(inner), self._left)

    def check(self, context, x, one, y_side, other_side, sqrt_2_pi, cubic, half=None, **scalars):
        result = self._check_product(x, half, one, y_side, other_side)
        if not (
            result
            and _expect(result, sqrt_2_pi, "the factor √(2/π) in tanh(√(2/π) · …)", SQRT_2_OVER_PI)
            and _expect(result, cubic, "the cubic coefficient", CUBIC)
        ):
            return result
        if "power" in scalars:
            return _expect(result, scalars["power"], "the exponent of Pow(x, 3)", 3.0)
        return _expect(result, scalars["one_inner"], "the 1 of (1 + 0.044715 · x · x)", 1.0)


def gelu_rule_list() -> list[RewriteRule]:
    """Both forms, one instance per left operand of the root ``Mul``."""
    return [cls.rule(left) for cls in (GeluErfFusion, GeluTanhFusion) for left in LEFT_OPERANDS]


def gelu_rules() -> RewriteRuleSet:
    return RewriteRuleSet(gelu_rule_list())
