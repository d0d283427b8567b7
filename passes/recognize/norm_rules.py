"""Rules that recognize LayerNorm and RMSNorm subgraphs as canonical ``tfgraph`` ops.

Canonical ops (domain ``tfgraph``), normalizing over the last axis:

- ``tfgraph.LayerNorm(x[, scale[, bias]]; epsilon)``: ``scale ⊙ (x − μ)/√(σ² + ε) + bias``
- ``tfgraph.RMSNorm(x[, scale]; epsilon)``: ``scale ⊙ x/√(mean(x²) + ε)``

``stash_type`` is the dtype of ``x``: an fp32 upcast (``Cast`` before the norm, as Llama and T5
write it) stays in the graph in front of the fused op, so the fold is exact.

Core forms (``d = x − ReduceMean(x)``; ``·²`` is ``Pow(·, 2)`` or ``Mul(·, ·)``)::

    LayerNorm:  x ─► ReduceMean ─► Sub(x, ·)=d ─► d² ─► ReduceMean ─┐          variance σ²
                x ─► x² ─► ReduceMean ─► Sub(·, ReduceMean(x)²) ────┤   or     E[x²] − E[x]²
                                     Add(σ², ε) ─► Sqrt ─► Div(d, ·) | Mul(d, Reciprocal(·))
    RMSNorm:    x ─► x² ─► ReduceMean ─► Add(·, ε) ─► Sqrt ─► Div(x, ·) | Mul(x, Reciprocal(·))

Then ``Mul(norm, γ)`` absorbs the scale and ``Add(norm, β)`` the bias (either operand order).

Rejections (the ``check`` reasons): ε not a constant scalar; reductions not over the last axis
alone; an exponent other than 2. The seed's ``(x − μ)/(σ + ε)`` (ε added to σ, not to σ²) is
matched by :class:`SeedLayerNormRule` only to explain why it is not folded: it is not what
``LayerNormalization`` computes, and a fold may not change results.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from tfgraph.passes.canonical import DOMAIN, LayerNormOp, RMSNormOp, norm_op
from tfgraph.passes.rewrite_utils import int_list, scalar


def square(op, v, name: str):
    return pattern.OrValue([op.Pow(v, pattern.Var(f"{name}_exp")), op.Mul(v, v)])


def _plus_epsilon(op, v, epsilon):
    return pattern.OrValue([op.Add(v, epsilon), v])


def check_common(result: pattern.MatchResult, x, epsilon, reductions, exponents):
    """ε constant; every ReduceMean over the last axis only; every Pow exponent 2."""
    # No ``Add(·, ε)`` at all: ε = 0 (our tracing removes only an exact ``+ 0``; other
    # optimizers, onnxscript's own no-op rules among them, drop an ε below 1e-8 as if 0).
    eps = 0.0 if epsilon is None else scalar(epsilon)
    if eps is None:
        return result.fail("epsilon is not a constant scalar", epsilon), None
    rank = len(x.shape) if x.shape is not None else None
    last = {-1} | ({rank - 1} if rank else set())
    for axes in reductions:
        values = int_list(axes)
        if values is None:
            return result.fail("reduction axes are not constant", axes), None
        if len(values) != 1 or values[0] not in last:
            return result.fail(
                f"normalizes over axes {values}, not the last axis alone", axes
            ), None
    for exp in exponents:
        if exp is not None and scalar(exp) != 2.0:
            return result.fail(f"exponent {scalar(exp)} is not 2", exp), None
    return result, eps


class _DivOrMulReciprocal(pattern.RewriteRuleClassBase):
    """The final division is ``Div(a, b)`` or ``Mul(a, Reciprocal(b))``; onnxscript's matcher
    cannot end a pattern in alternatives, so each rule has one instance per form."""

    def __init__(self, use_div: bool) -> None:
        super().__init__(f"{type(self).__name__}{'Div' if use_div else 'MulReciprocal'}")
        self._use_div = use_div

    def _divide(self, op, a, b):
        return op.Div(a, b) if self._use_div else op.Mul(a, op.Reciprocal(b))

    @classmethod
    def rules(cls) -> list[pattern.RewriteRule]:
        return [cls.rule(True), cls.rule(False)]


class LayerNormRule(_DivOrMulReciprocal):
    """1. ``(x − μ)/√(σ² + ε)`` with σ² the mean squared deviation;
    2. the same with σ² computed as ``E[x²] − E[x]²``; each with Div or Mul-by-Reciprocal."""

    def pattern(self, op, x, axes_mean, axes_var, epsilon):
        mean = op.ReduceMean(x, axes_mean)
        d = op.Sub(x, mean)
        var = pattern.OrValue(
            [
                op.ReduceMean(square(op, d, "dev"), axes_var),
                op.Sub(op.ReduceMean(square(op, x, "x"), axes_var), square(op, mean, "mean")),
            ]
        )
        return self._divide(op, d, op.Sqrt(_plus_epsilon(op, var, epsilon)))

    def check(self, context, x, axes_mean, axes_var, epsilon=None, **kw) -> pattern.MatchResult:
        exps = [kw.get(k) for k in ("dev_exp", "x_exp", "mean_exp")]
        result, self._epsilon = check_common(
            pattern.MatchResult(), x, epsilon, [axes_mean, axes_var], exps
        )
        return result

    def rewrite(self, op, x, **_):
        return LayerNormOp(self._epsilon).make(op, x)


class RMSNormRule(_DivOrMulReciprocal):
    """``x/√(mean(x²) + ε)`` with Div or Mul-by-Reciprocal (``x * rsqrt(mean(x²) + ε)``)."""

    def pattern(self, op, x, axes, epsilon):
        rms = op.Sqrt(_plus_epsilon(op, op.ReduceMean(square(op, x, "x"), axes), epsilon))
        return self._divide(op, x, rms)

    def check(self, context, x, axes, epsilon=None, x_exp=None, **_) -> pattern.MatchResult:
        result, self._epsilon = check_common(pattern.MatchResult(), x, epsilon, [axes], [x_exp])
        return result

    def rewrite(self, op, x, **_):
        return RMSNormOp(self._epsilon).make(op, x)


class SeedLayerNormRule(pattern.RewriteRuleClassBase):
    """The seed's ``σ + ε`` (ε added to the standard deviation). Never rewrites: its only
    purpose is the reason it gives, which the report shows."""

    REASON = (
        "(x−μ)/(σ+ε) adds ε to σ, LayerNormalization computes (x−μ)/√(σ²+ε): "
        "not folded, to keep results exact"
    )

    def pattern(self, op, x, axes_mean, axes_var, epsilon):
        d = op.Sub(x, op.ReduceMean(x, axes_mean))
        return op.Add(op.Sqrt(op.ReduceMean(square(op, d, "dev"), axes_var)), epsilon)

    def __init__(self) -> None:
        super().__init__(remove_nodes=False)  # σ is only part of the norm: do not ask for more

    def check(self, context, epsilon, **_) -> pattern.MatchResult:
        return pattern.MatchResult().fail(self.REASON, epsilon)

    def rewrite(self, op, **_):  # pragma: no cover - check() always fails
        raise AssertionError("the seed's norm is never rewritten")


class StandardNormRule(pattern.RewriteRuleClassBase):
    """``LayerNormalization`` / ``RMSNormalization`` nodes (``nn.LayerNorm`` traces to the
    former; the exporter's optimizer makes the latter at opset 23) become canonical ops, so each
    profile lowers them its own way (e.g. with the residual ``Add``)."""

    def __init__(self, op_type: str, with_bias: bool) -> None:
        super().__init__(f"{op_type}{'Bias' if with_bias else ''}ToCanonical")
        self._op_type, self._with_bias = op_type, with_bias

    def pattern(self, op, x, scale, bias):
        inputs = [x, scale, bias] if self._with_bias else [x, scale]
        return getattr(op, self._op_type)(*inputs, _outputs=["y"])

    def check(self, context, x, y, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        node = y.producer()
        axis = node.attributes.get_int("axis", -1)
        rank = len(x.shape) if x.shape is not None else None
        if axis != -1 and axis != (rank or 0) - 1:
            return result.fail(f"normalizes from axis {axis}, not the last axis alone", x)
        if node.attributes.get_int("stash_type", 1) != 1:
            return result.fail("computes in a precision other than fp32 (stash_type)", x)
        return result

    def rewrite(self, op, x, scale, y, bias=None, **_):
        eps = y.producer().attributes.get_float("epsilon", 1e-5)
        canonical = "LayerNorm" if self._op_type == "LayerNormalization" else "RMSNorm"
        inputs = [x, scale, bias] if bias is not None else [x, scale]
        return norm_op(canonical, eps).make(op, *inputs)


class CenteredRMSNormRule(pattern.RewriteRuleClassBase):
    """``RMSNormalization(x − mean(x))`` is LayerNorm without bias (what the exporter's
    optimizer makes of a hand-written LayerNorm at opset 23)."""

    def pattern(self, op, x, axes, scale):
        d = op.Sub(x, op.ReduceMean(x, axes))
        return op.RMSNormalization(d, scale, _outputs=["y"])

    def check(self, context, x, axes, y, **_) -> pattern.MatchResult:
        result, _ = check_common(pattern.MatchResult(), x, None, [axes], [])
        if result and y.producer().attributes.get_int("axis", -1) not in (-1, len(x.shape) - 1):
            return result.fail("RMSNormalization is not over the last axis", y)
        return result

    def rewrite(self, op, x, scale, y, **_):
        eps = y.producer().attributes.get_float("epsilon", 1e-5)
        return LayerNormOp(eps).make(op, x, scale)


def _per_feature(value: ir.Value) -> bool:
    """A 1-D (or all-but-last-dims-1) tensor: one scale or bias per feature."""
    shape = value.shape
    if shape is None:
        return False
    dims = list(shape)
    return len(dims) >= 1 and all(d == 1 for d in dims[:-1])


class NormScaleRule(pattern.RewriteRuleClassBase):
    """``Mul(norm(x), γ)`` → ``norm(x, γ)`` for a per-feature γ (commuted: ``Mul(γ, norm)``)."""

    def __init__(self, op_type: str) -> None:
        super().__init__(f"{op_type}Scale")
        self._op_type = op_type

    def pattern(self, op, x, scale):
        norm = getattr(op, self._op_type)(x, _domain=DOMAIN, _outputs=["n"])
        return op.Mul(norm, scale)

    def check(self, context, scale, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if not _per_feature(scale):
            return result.fail("the scale is not one value per feature", scale)
        return result

    def rewrite(self, op, x, scale, n, **_):
        eps = n.producer().attributes["epsilon"].value
        return norm_op(self._op_type, eps).make(op, x, scale)


class LayerNormBiasRule(pattern.RewriteRuleClassBase):
    """``Add(LayerNorm(x, γ), β)`` → ``LayerNorm(x, γ, β)`` for a per-feature β."""

    def pattern(self, op, x, scale, bias):
        return op.Add(op.LayerNorm(x, scale, _domain=DOMAIN, _outputs=["n"]), bias)

    def check(self, context, bias, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if not _per_feature(bias):
            return result.fail("the bias is not one value per feature", bias)
        return result

    def rewrite(self, op, x, scale, bias, n, **_):
        eps = n.producer().attributes["epsilon"].value
        return LayerNormOp(eps).make(op, x, scale, bias)


CORE_RULES = [
    *LayerNormRule.rules(),
    *RMSNormRule.rules(),
    CenteredRMSNormRule.rule(),
    StandardNormRule.rule("LayerNormalization", True),
    StandardNormRule.rule("LayerNormalization", False),
    StandardNormRule.rule("RMSNormalization", False),
]
AFFINE_RULES = [
    NormScaleRule.rule("LayerNorm"),
    NormScaleRule.rule("RMSNorm"),
    LayerNormBiasRule.rule(),
]
DIAGNOSTIC_RULES = [*LayerNormRule.rules(), *RMSNormRule.rules(), SeedLayerNormRule.rule()]
