"""``FuseGeluPass``: hand-written GELU → ``tfgraph.Gelu``; each miss is recorded with its cause."""

from __future__ import annotations

import logging
import math

import onnx_ir as ir

from tfgraph.passes.recognize.gelu_rules import CUBIC, gelu_rules
from tfgraph.passes.rewrite_utils import apply_rules, diagnose, mark_missed, scalar

logger = logging.getLogger(__name__)

# How far upstream of a Tanh to look for the cube of the tanh form; 4 hops in both forms.
TANH_CANDIDATE_DEPTH = 5


class FuseGeluPass(ir.passes.InPlacePass):
    """Fuse hand-written GELU into ``tfgraph.Gelu(x, approximate=...)``.

    1. For any subgraph ``0.5 · x · (1 + erf(x / √2))``, replace it with
       ``tfgraph.Gelu(x, approximate="none")``.
    2. For any subgraph ``0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`` (GPT-2), or
       ``0.5 · x · (1 + tanh(√(2/π) · x · (1 + 0.044715 · x · x)))`` (BLOOM), replace it with
       ``tfgraph.Gelu(x, approximate="tanh")``.

    The operand orders and groupings accepted are those of :mod:`.gelu_rules`. Every GELU left
    unfused (:func:`unfused_gelu_candidates`) gets the reason in its ``Erf`` or ``Tanh`` node's
    ``tfgraph.miss_reason`` metadata. ``modified`` counts fusions only: metadata alone is not a
    modification, so a second run reports ``modified=False``.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        rules = gelu_rules()
        fused = apply_rules(model, rules)
        missed = unfused_gelu_candidates(model)
        for node in missed:
            reason = diagnose(model, rules.rules, node)
            mark_missed(node, reason)
            logger.debug("GELU at %s (%s) not fused: %s", node.name, node.op_type, reason)
        logger.info("GELU: %d fused, %d missed", fused, len(missed))
        return ir.passes.PassResult(model, modified=fused > 0)


def unfused_gelu_candidates(model: ir.Model) -> list[ir.Node]:
    """One node per GELU left unfused: its ``Erf``, or its ``Tanh`` near a cube of ``x``.

    A ``Tanh`` counts when, within :data:`TANH_CANDIDATE_DEPTH` hops upstream, there is a
    ``Pow(·, 3)`` or a ``Mul`` by 0.044715; a ``Tanh`` on its own is not a GELU.
    """
    return [
        node
        for node in model.graph.all_nodes()
        if node.domain in ("", "ai.onnx")
        and (node.op_type == "Erf" or (node.op_type == "Tanh" and _near_cube(node)))
    ]


def _near_cube(node: ir.Node) -> bool:
    frontier, seen = [node], {id(node)}
    for _ in range(TANH_CANDIDATE_DEPTH):
        producers = []
        for current in frontier:
            for value in current.inputs:
                producer = value.producer() if value is not None else None
                if producer is not None and id(producer) not in seen:
                    seen.add(id(producer))
                    producers.append(producer)
        if any(_is_cube_term(p) for p in producers):
            return True
        frontier = producers
    return False


def _is_cube_term(node: ir.Node) -> bool:
    """``Pow(·, 3)``, or a ``Mul`` by 0.044715 (within float16 rounding)."""
    if node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return False
    if node.op_type == "Pow":
        return scalar(node.inputs[1]) == 3
    return node.op_type == "Mul" and any(
        (c := scalar(v)) is not None and math.isclose(c, CUBIC, rel_tol=1e-3) for v in node.inputs
    )
