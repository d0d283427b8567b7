"""Recognize attention cores as ``tfgraph.Attention`` (see :mod:`.rules` and
:mod:`.onnx_attention`)."""

from __future__ import annotations

import logging

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnxscript.rewriter import RewriteRuleSet

import tfgraph.passes.recognize.attention.concat_keys as concat_keys_rules
import tfgraph.passes.recognize.attention.einsum as einsum_rules
import tfgraph.passes.recognize.attention.onnx_attention as onnx_attention_rules
import tfgraph.passes.recognize.attention.rules as attention_rules
import tfgraph.passes.recognize.attention.separable as separable_attention_rules
import tfgraph.passes.recognize.attention.sink as sink_rules
import tfgraph.passes.recognize.attention.windowed_mask as windowed_mask_rules
from tfgraph.passes.recognize.attention.gating_softmax import is_gating_softmax
from tfgraph.passes.rewrite_utils import apply_rules, constant, diagnose, mark_missed

logger = logging.getLogger(__name__)


_SCORE_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Tanh", "Softmax"})


def unshare_softmax(model: ir.Model) -> int:
    """Give each ``MatMul(probs, V_i)`` its own copy of the scores → softmax chain when one
    softmax feeds several (DiffLlama's two attention calls on the same Q and K, merged by common
    subexpression elimination): the core rules take an attention whose nodes have no other
    uses. The copies are the same ops on the same inputs; returns how many were made."""
    made = 0
    graph = model.graph
    for softmax in list(graph):
        if softmax.op_type != "Softmax" or softmax.domain not in ("", "ai.onnx"):
            continue
        tail = _nan_guard(softmax)  # [softmax] or [softmax, IsNaN, Where] (SDPA's guard)
        uses = list(tail[-1].outputs[0].uses())
        if len(uses) < 2 or any(u.node.op_type != "MatMul" or u.idx != 0 for u in uses):
            continue
        chain, node = [], softmax
        while node is not None and len(chain) < 8:
            chain.append(node)
            if node.op_type == "MatMul":
                break
            if node.op_type not in _SCORE_OPS:
                node = None
                break
            node = node.inputs[0].producer() if node.inputs[0] is not None else None
        if node is None or node.op_type != "MatMul":
            continue  # not a Q·Kᵀ chain
        scales = [  # SDPA's decomposition scales Q and Kᵀ by √scale each: copied too
            i.producer()
            for i in node.inputs
            if i is not None
            and i.producer() is not None
            and i.producer().op_type == "Mul"
            and any(constant(x) is not None for x in i.producer().inputs)
        ]
        chain.reverse()  # Q·Kᵀ first
        chain = scales + chain + tail[1:]
        for k, use in enumerate(uses[1:], 1):
            mapped: dict[ir.Value, ir.Value] = {}
            clones = []
            for orig in chain:
                inputs = [mapped.get(v, v) for v in orig.inputs]
                clone = ir.Node(
                    orig.domain,
                    orig.op_type,
                    inputs,
                    attributes=list(orig.attributes.values()),
                    num_outputs=1,
                    name=f"{orig.name}_unshared{k}",
                )
                clone.metadata_props.update(orig.metadata_props)
                out, old = clone.outputs[0], orig.outputs[0]
                out.name = f"{old.name}_unshared{k}"
                out.shape, out.type = old.shape, old.type
                mapped[old] = out
                clones.append(clone)
            graph.insert_before(use.node, clones)
            use.node.replace_input_with(0, mapped[tail[-1].outputs[0]])
            made += 1
    return made


def _nan_guard(softmax: ir.Node) -> list[ir.Node]:
    """``[softmax, IsNaN, Where]`` when the softmax's only uses are ``Where(IsNaN(p), c, p)``;
    else ``[softmax]``."""
    p = softmax.outputs[0]
    users = {u.node.op_type: u.node for u in p.uses()}
    if len(p.uses()) != 2 or set(users) != {"IsNaN", "Where"}:
        return [softmax]
    isnan, where = users["IsNaN"], users["Where"]
    if where.inputs[0] is not isnan.outputs[0] or where.inputs[2] is not p:
        return [softmax]
    return [softmax, isnan, where]


def _looks_like_sinks(softmax: ir.Node) -> bool:
    """A softmax over a concatenation whose last column a Slice drops (attention sinks)."""
    producer = softmax.inputs[0].producer() if softmax.inputs[0] is not None else None
    if producer is not None and producer.op_type == "Sub":
        producer = producer.inputs[0].producer()
    sliced = any(use.node.op_type == "Slice" for use in softmax.outputs[0].uses())
    return producer is not None and producer.op_type == "Concat" and sliced


class FuseAttentionPass(ir.passes.InPlacePass):
    """Fuse every attention core into one ``tfgraph.Attention``.

    0. Einsum contractions around a softmax become ``MatMul`` (:mod:`.einsum_rules`); scores
       masked by a 0/1 buffer (:class:`.score_masks.MultiplicativeMaskRule`) or by
       selection (``Where(keep, s, −inf)``, ``masked_fill``) become scores plus an additive
       mask (:class:`.score_masks.SelectionMaskRule`), and probabilities zeroed again on
       the same condition lose that zeroing (:class:`.score_masks.ZeroMaskedProbsRule`);
       two biases added one after the other become one
       (:class:`.score_masks.StackedBiasRule`); a softmax with attention sinks becomes
       ``tfgraph.SinkSoftmax`` (:mod:`.sink`); a softmax feeding several
       ``MatMul(probs, V_i)`` gets one copy of its chain per V (:func:`unshare_softmax`);
       scores of two key sets joined for one softmax and probabilities split again for two
       value sets become one attention over the concatenated keys and values
       (:mod:`.concat_keys_rules`: PEGASUS-X's block-local attention); a mask added on a
       view of the scores that is viewed back before the softmax (shifted-window attention:
       Swin) becomes a bias on the scores (:mod:`.windowed_mask`).
    1. ``MatMul(Softmax(scale·Q·Kᵀ [+ bias]), V)`` in any of its exported forms becomes
       ``tfgraph.Attention(Q, Transpose(Kᵀ), V[, bias])``; so does a standard ONNX
       ``Attention`` (SDPA exported at opset ≥ 23), to be lowered for the profile like the rest.
       What is left with Q, Kᵀ, V of one rank other than 4 and the same leading dims
       (heads folded into the batch, or a window axis) fuses on one-head (N, 1, ·, ·) views
       (:data:`.rules.FLAT_RULES`).
       A softmax-weighted sum over the softmax's axis (MobileViTV2's separable attention:
       logits given directly, one query) becomes one too (:mod:`.separable`).
    2. Layout cleanup: the transpose of Kᵀ cancels against the ones that built it (plain or
       SDPA's 3-D view), and a ``repeat_interleave`` of K and V (GQA/MQA) is absorbed into
       ``kv_num_heads``.
    3. Each attention core left unfused (a ``Softmax``, or an ONNX ``Attention``, still in the
       graph) gets the reason the rules failed on it; a ``SinkSoftmax`` left unfused goes back
       to standard ops first.

    ``modified`` is True only when a core was fused.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        masked = apply_rules(model, RewriteRuleSet(einsum_rules.EINSUM_RULES))  # → MatMul
        masked += apply_rules(model, RewriteRuleSet(concat_keys_rules.CONCAT_KEYS_RULES))
        masked += apply_rules(model, RewriteRuleSet(windowed_mask_rules.RULES))  # Swin's views
        masked += apply_rules(model, RewriteRuleSet(attention_rules.MASK_RULES))  # → additive
        masked += apply_rules(model, RewriteRuleSet(attention_rules.BIAS_RULES))  # one bias
        masked += apply_rules(model, RewriteRuleSet(sink_rules.SINK_RULES))  # → SinkSoftmax
        masked += unshare_softmax(model)  # one softmax, several V: one chain per V
        if masked:  # the score sums the mask rules rebuilt are dead: they block the core rules
            common.RemoveUnusedNodesPass()(model)
        count = apply_rules(model, RewriteRuleSet(attention_rules.CORE_RULES))
        count += apply_rules(model, RewriteRuleSet(onnx_attention_rules.RULES))
        count += apply_rules(model, RewriteRuleSet(attention_rules.FLAT_RULES))  # heads in N
        count += apply_rules(model, RewriteRuleSet(separable_attention_rules.RULES))  # 1 query
        if count:
            for _ in range(2):  # cancel transposes, drop the Identity, then absorb repeat_kv
                apply_rules(model, RewriteRuleSet(attention_rules.LAYOUT_RULES))
                common.IdentityEliminationPass()(model)
                common.RemoveUnusedNodesPass()(model)  # dead shape arithmetic blocks removal
        for node in list(model.graph):
            if sink_rules.is_sink_softmax(node):  # not fused: back to standard ops, reported
                reason = diagnose(model, attention_rules.CORE_RULES, node, depth=3)
                mark_missed(sink_rules.restore_sink_softmax(model, node), reason)
            elif node.op_type == "Softmax" and node.domain in ("", "ai.onnx"):
                if is_gating_softmax(node):
                    continue
                reason = diagnose(model, attention_rules.CORE_RULES, node, depth=3)
                if _looks_like_sinks(node):  # why the sink rules refused says more
                    sink_reason = diagnose(model, sink_rules.SINK_RULES, node, depth=1)
                    reason = sink_reason if "no rule matched" not in sink_reason else reason
                if windowed_mask_rules.looks_windowed(node):  # Swin: why the view's rule refused
                    why = diagnose(model, windowed_mask_rules.RULES, node, depth=1)
                    reason = f"{windowed_mask_rules.PREFIX}: {why}"
                mark_missed(node, reason)
            elif node.op_type == "Attention" and node.domain in ("", "ai.onnx"):
                mark_missed(node, diagnose(model, onnx_attention_rules.RULES, node, depth=0))
        logger.info("fused %d attention cores", count)
        return ir.passes.PassResult(model, modified=bool(count or masked))
