"""Exact versions of onnxscript's no-op rules (``x + 0``, ``x − 0``, ``x · 1``, ``x / 1``).

onnxscript's ``_no_op`` rules compare the constant with ``math.isclose`` (``abs_tol=1e-8``,
``rel_tol=1e-5``), so ``x + 1e-12`` and ``x · 1.000001`` are removed as if they were no-ops.
That changes results: the seed's ``(x − μ)/(σ + ε)`` with BERT's ε = 1e-12 lost its ``+ ε``,
which turns a constant row's 0/1e-12 = 0 into 0/0 = NaN, and the norm no longer matched its
recognition rule (found by ``python -m tfgraph fuzz``). These rules remove an operation only
when its constant is exactly the identity element, a scalar, of the same dtype as ``x``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from tfgraph.onnxscript_private import NO_OP_RULES as _no_op


class _ExactNoOp(pattern.RewriteRuleClassBase):
    """``op(x, c)`` (or ``op(c, x)`` where the op commutes) with ``c`` exactly ``identity``."""

    def __init__(self, op_type: str, identity: float, constant_first: bool) -> None:
        side = "CX" if constant_first else "XC"
        super().__init__(f"Exact{op_type}NoOp{side}")
        self._op_type, self._identity, self._constant_first = op_type, identity, constant_first

    def pattern(self, op, x, c):
        args = (c, x) if self._constant_first else (x, c)
        return getattr(op, self._op_type)(*args)

    def check(self, context, x, c, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        tensor = ir.convenience.get_const_tensor(c)
        if tensor is None:
            return result.fail("not a constant", c)
        array = tensor.numpy()
        if array.ndim != 0:  # a shaped constant could broadcast x to a larger shape
            return result.fail("not a scalar", c)
        if x.dtype is None or x.dtype != c.dtype:
            return result.fail("dtype differs from x (or unknown)", c)
        if not np.all(array == self._identity):
            return result.fail(f"{array.item()} is not exactly {self._identity}", c)
        return result

    def rewrite(self, op, x, **_):
        return op.Identity(x)


def _known_dims(shape) -> bool:
    return shape is not None and all(
        isinstance(d, int) or getattr(d, "value", None) is not None for d in shape
    )


class _AddExpandedZero(pattern.RewriteRuleClassBase):
    """``x + Expand(0, shape)`` to ``x`` where the sum has x's own shape (``torch.baddbmm``
    from a ``zeros`` tensor, as GPT-NeoX-Japanese scores Q·Kᵀ): exact, and the broadcast does
    not enlarge x, both dims stated."""

    def __init__(self, zeros_first: bool) -> None:
        super().__init__("AddExpandedZero" + ("ZX" if zeros_first else "XZ"))
        self._zeros_first = zeros_first

    def pattern(self, op, x, c, shape):
        zeros = op.Expand(c, shape)
        args = (zeros, x) if self._zeros_first else (x, zeros)
        return op.Add(*args, _outputs=["total"])

    def check(self, context, x, c, total, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        tensor = ir.convenience.get_const_tensor(c)
        if tensor is None or tensor.numpy().ndim != 0 or not np.all(tensor.numpy() == 0):
            return result.fail("not an expanded scalar 0", c)
        if x.dtype is None or x.dtype != c.dtype:
            return result.fail("dtype differs from x (or unknown)", c)
        if not (_known_dims(x.shape) and _known_dims(total.shape)) or x.shape != total.shape:
            return result.fail("the expanded zeros could broadcast x to a larger shape", total)
        return result

    def rewrite(self, op, x, **_):
        return op.Identity(x)


EXACT_NO_OP_RULES = [
    _AddExpandedZero.rule(False),
    _AddExpandedZero.rule(True),
    _ExactNoOp.rule("Add", 0.0, False),
    _ExactNoOp.rule("Add", 0.0, True),
    _ExactNoOp.rule("Sub", 0.0, False),
    _ExactNoOp.rule("Mul", 1.0, False),
    _ExactNoOp.rule("Mul", 1.0, True),
    _ExactNoOp.rule("Div", 1.0, False),
]

# onnxscript's tolerant versions: replaced by the rules above. Its Dropout rules are exact.
_EXACT_ALREADY = (_no_op.dropout_zero_rule, _no_op.dropout_inference_rule)
TOLERANT_NO_OP_RULES = {
    id(r) for r in _no_op.rules.rules if not any(r is d for d in _EXACT_ALREADY)
}


def exact(rules: list) -> list:
    """``rules`` with onnxscript's tolerant no-op rules swapped for :data:`EXACT_NO_OP_RULES`."""
    kept = [r for r in rules if id(r) not in TOLERANT_NO_OP_RULES]
    if len(kept) == len(rules):
        raise RuntimeError("onnxscript's no-op rules were not found in its default rule list")
    return EXACT_NO_OP_RULES + kept
