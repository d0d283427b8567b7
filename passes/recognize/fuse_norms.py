"""Recognize LayerNorm and RMSNorm subgraphs as ``tfgraph.LayerNorm`` / ``tfgraph.RMSNorm``."""

from __future__ import annotations

import logging

import onnx_ir as ir
from onnxscript.rewriter import RewriteRuleSet

import tfgraph.passes.recognize.norm_rules as norm_rules
import tfgraph.passes.recognize.normalize_rules as normalize_rules
from tfgraph.passes.recognize.norm_products import reorder_norm_products
from tfgraph.passes.recognize.norm_scales import fold_norm_scales
from tfgraph.passes.rewrite_utils import apply_rules, diagnose, mark_missed, scalar

logger = logging.getLogger(__name__)


def _is_square(value: ir.Value | None) -> bool:
    node = value.producer() if value is not None else None
    if node is None:
        return False
    if node.op_type == "Mul" and len(node.inputs) == 2:
        return node.inputs[0] is node.inputs[1]
    if node.op_type == "Pow" and len(node.inputs) == 2:
        return scalar(node.inputs[1]) == 2.0
    return False


def _feeds_root(node: ir.Node, depth: int = 3) -> bool:
    """The node's output reaches a ``Sqrt`` through at most ``depth`` ``Add`` (ε), ``Max`` /
    ``Clip`` (a floor), ``Div`` / ``Mul`` (by d) nodes."""
    for use in node.outputs[0].uses():
        user = use.node
        if user.op_type == "Sqrt":
            return True
        if depth and user.op_type in ("Add", "Max", "Clip", "Div", "Mul") and user.outputs:
            if _feeds_root(user, depth - 1):
                return True
    return False


def is_l2_candidate(node: ir.Node) -> bool:
    """An L2 norm: ``ReduceL2``, ``LpNormalization``, or a sum of squares under a root."""
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type in ("ReduceL2", "LpNormalization"):
        return True
    if node.op_type == "ReduceSumSquare" or (
        node.op_type == "ReduceSum" and _is_square(node.inputs[0])
    ):
        return _feeds_root(node)
    return False


def is_norm_candidate(node: ir.Node) -> bool:
    """A decomposed norm, one node each: a ``ReduceMean`` of a square (variance or mean
    square), or an L2 norm (:func:`is_l2_candidate`)."""
    if node.domain in ("", "ai.onnx") and node.op_type == "ReduceMean":
        return _is_square(node.inputs[0])
    return is_l2_candidate(node)


def unfused_norm_candidates(model: ir.Model) -> list[ir.Node]:
    """One node per decomposed norm left in the graph (:func:`is_norm_candidate`)."""
    return [n for n in model.graph if is_norm_candidate(n)]


class FuseNormsPass(ir.passes.InPlacePass):
    """Fold decomposed norms into canonical ``tfgraph`` ops (see :mod:`.norm_rules`).

    0. The products of a hand-written norm are put in one order
       (:mod:`.norm_products`: ``w * x * rsqrt(…)`` → ``(x * rsqrt(…)) * w``, …).
    1. Every core form (LayerNorm with either variance form, RMSNorm) becomes
       ``tfgraph.LayerNorm(x)`` / ``tfgraph.RMSNorm(x)``; an L2-normalize over the last axis
       (``F.normalize``, :mod:`.normalize_rules`) becomes ``tfgraph.RMSNorm(x) · 1/√d``.
    2. A following per-feature ``Mul(·, γ)`` and, for LayerNorm, ``Add(·, β)`` are absorbed;
       then the constants still multiplying an RMSNorm are folded into its γ
       (:mod:`.norm_scales`).
    3. Each decomposed norm still left gets the reason the rules failed on it
       (``tfgraph.miss_reason``); the seed's ``(σ + ε)`` norm is marked excluded on purpose.

    ``modified`` is True only when a norm was folded (reasons are bookkeeping).
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        reordered = reorder_norm_products(model)
        count = apply_rules(model, RewriteRuleSet(norm_rules.CORE_RULES))
        count += apply_rules(model, RewriteRuleSet(normalize_rules.RULES))
        if count:
            count += apply_rules(model, RewriteRuleSet(norm_rules.AFFINE_RULES, commute=True))
            count += fold_norm_scales(model)
        for node in unfused_norm_candidates(model):
            if is_l2_candidate(node):
                reason = diagnose(model, normalize_rules.DIAGNOSTIC_RULES, node)
            else:
                reason = diagnose(model, norm_rules.DIAGNOSTIC_RULES, _norm_root(node))
            excluded = reason == norm_rules.SeedLayerNormRule.REASON
            mark_missed(node, reason, excluded=excluded)
            logger.debug("norm left unfused at %s: %s", node.name, reason)
        logger.info("norm rules applied %d times (core, scale and bias rewrites)", count)
        return ir.passes.PassResult(model, modified=bool(count or reordered))


def _norm_root(candidate: ir.Node) -> ir.Node:
    """Start diagnosis at the first ReduceMean of the norm (the mean of x for LayerNorm)."""
    square = candidate.inputs[0].producer()
    source = square.inputs[0].producer() if square is not None else None
    if source is not None and source.op_type == "Sub":
        mean = source.inputs[1].producer()
        if mean is not None and mean.op_type == "ReduceMean":
            return mean
    return candidate
