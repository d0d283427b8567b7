"""``LowerGeluPass``: ``tfgraph.Gelu`` → the GELU op its target chooses."""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter.pattern import RewriteRuleClassBase, RewriteRuleSet

from tfgraph.passes.canonical import DOMAIN, GeluOp, is_canonical
from tfgraph.passes.rewrite_utils import apply_rules, import_used_domains, mark_missed
from tfgraph.passes.target_arg import require_target

logger = logging.getLogger(__name__)

GELU_OPSET = 20  # Gelu joined the default domain in opset 20
NEEDS_OPSET = f"Gelu needs opset {GELU_OPSET}"


class LowerGeluPass(ir.passes.InPlacePass):
    """Replace every ``tfgraph.Gelu`` with its target's op (``target.lower_gelu``).

    The standard builder, :func:`standard_gelu`, when the model's default-domain opset is 20
    or more: ``y = Gelu(x, approximate=...)`` of the standard domain; below opset 20 the
    standard ops of the formula, ``0.5 · x · (1 + erf(x · 1/√2))`` or
    ``0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))``, with the reason
    ``"Gelu needs opset 20"`` on the ``Erf`` or ``Tanh`` node. A target with its own GELU
    kernels builds them itself (``ort``: ``tfgraph.exporters.ort.gelu``).

    No other op is lowered. ``modified`` counts replaced nodes; a second run reports ``False``.
    ``target``: a :class:`tfgraph.exporters.target.Target`
    (``tfgraph.exporters.targets.get_target(name)``).
    """

    def __init__(self, target) -> None:
        super().__init__()
        self.target = require_target(target)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
        rule = GeluLowering.rule(self.target, opset)
        lowered = apply_rules(model, RewriteRuleSet([rule]))
        if lowered:
            import_used_domains(model)
        logger.info("lowered %d tfgraph.Gelu for %s (opset %d)", lowered, self.target.name, opset)
        return ir.passes.PassResult(model, modified=lowered > 0)

    def ensures(self, model: ir.Model) -> None:
        for node in model.graph.all_nodes():
            if is_canonical(node, GeluOp.OP):
                raise ir.passes.PostconditionError(f"{node.name}: tfgraph.Gelu left unlowered")


class GeluLowering(RewriteRuleClassBase):
    """``tfgraph.Gelu(x)`` → the target's op (see :class:`LowerGeluPass`)."""

    def __init__(self, target, opset: int) -> None:
        super().__init__(name=f"LowerGelu[{target.name}, opset {opset}]")
        self._target, self._opset = target, opset

    def pattern(self, op, x):
        return op.Gelu(x, _domain=DOMAIN, _outputs=["gelu"])

    def rewrite(self, op, x, gelu):
        spec = GeluOp.read(gelu.producer())
        return self._target.lower_gelu(op, x, spec, self._opset)


def standard_gelu(op, x, spec: GeluOp, opset: int):
    """``Gelu``-20, or its formula in standard ops below opset 20 (reported as missed)."""
    if opset >= GELU_OPSET:
        return op.Gelu(x, approximate=spec.approximate)
    return _expand(op, x, spec.approximate)


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
