"""``LowerGeluPass``: ``tfgraph.Gelu`` → the GELU op of a target profile."""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter.pattern import RewriteRuleClassBase, RewriteRuleSet

from .rewrite_utils import DOMAIN, apply_rules, mark_missed

logger = logging.getLogger(__name__)

PROFILES = ("ort", "onnx", "tensorrt")
MS_DOMAIN = "com.microsoft"
GELU_OPSET = 20  # Gelu joined the default domain in opset 20
NEEDS_OPSET = f"Gelu needs opset {GELU_OPSET}"


class LowerGeluPass(ir.passes.InPlacePass):
    """Replace every ``tfgraph.Gelu`` with the op of ``profile``.

    1. ``"ort"``: ``y = tfgraph.Gelu(x, approximate="none")`` becomes
       ``y = com.microsoft::Gelu(x)``, and ``approximate="tanh"`` becomes
       ``y = com.microsoft::FastGelu(x)`` (both in ONNX Runtime's CPU provider, checked against
       ``torch.nn.functional.gelu`` to 1e-6); the ``com.microsoft`` opset (version 1) is
       imported.
    2. ``"onnx"`` and ``"tensorrt"``, when the model's default-domain opset is 20 or more:
       ``y = Gelu(x, approximate=...)`` of the standard domain.
    3. ``"onnx"`` and ``"tensorrt"`` below opset 20: the standard ops of the formula,
       ``0.5 · x · (1 + erf(x · 1/√2))`` or ``0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))``,
       with the reason ``"Gelu needs opset 20"`` on the ``Erf`` or ``Tanh`` node.

    No other op is lowered. ``modified`` counts replaced nodes; a second run reports ``False``.
    """

    def __init__(self, profile: str) -> None:
        super().__init__()
        if profile not in PROFILES:
            raise ValueError(f"unknown profile '{profile}': choose one of {', '.join(PROFILES)}")
        self.profile = profile

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
        rule = GeluLowering.rule(self.profile, opset)
        lowered = apply_rules(model, RewriteRuleSet([rule]))
        if lowered and self.profile == "ort":
            model.opset_imports.setdefault(MS_DOMAIN, 1)
        logger.info("lowered %d tfgraph.Gelu for %s (opset %d)", lowered, self.profile, opset)
        return ir.passes.PassResult(model, modified=lowered > 0)

    def ensures(self, model: ir.Model) -> None:
        for node in model.graph.all_nodes():
            if node.domain == DOMAIN and node.op_type == "Gelu":
                raise ir.passes.PostconditionError(f"{node.name}: tfgraph.Gelu left unlowered")


class GeluLowering(RewriteRuleClassBase):
    """``tfgraph.Gelu(x)`` → the profile's op (see :class:`LowerGeluPass` for the cases)."""

    def __init__(self, profile: str, opset: int) -> None:
        super().__init__(name=f"LowerGelu[{profile}, opset {opset}]")
        self._profile, self._opset = profile, opset

    def pattern(self, op, x):
        return op.Gelu(x, _domain=DOMAIN, _outputs=["gelu"])

    def rewrite(self, op, x, gelu):
        approximate = gelu.producer().attributes.get_string("approximate", "none")
        if self._profile == "ort":
            ms_op = op.FastGelu if approximate == "tanh" else op.Gelu
            return ms_op(x, _domain=MS_DOMAIN)
        if self._opset >= GELU_OPSET:
            return op.Gelu(x, approximate=approximate)
        return _expand(op, x, approximate)


def _expand(op, x, approximate: str):
    """GELU written out in standard ops (the formulas ``FuseGeluPass`` recognizes)."""
    dtype = x.dtype.numpy() if x.dtype is not None else np.float32

    def const(value: float):
        return op.Constant(value=ir.tensor(np.array(value, dtype=dtype)))

    if approximate == "tanh":
        cube = op.Mul(op.Pow(x, const(3.0)), const(0.044715))
        f = op.Tanh(op.Mul(op.Add(x, cube), const(math.sqrt(2.0 / math.pi))))
    else:
        f = op.Erf(op.Mul(x, const(1.0 / math.sqrt(2.0))))
    mark_missed(f.producer(), NEEDS_OPSET)
    return op.Mul(op.Mul(x, const(0.5)), op.Add(f, const(1.0)))
