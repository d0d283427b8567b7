"""Carry the state of every recurrent layer across steps, the way the KV cache carries keys.

Runs on the canonical recurrent ops (:mod:`.canonical`: ``tfgraph.CausalConv``,
``tfgraph.LinearAttention``), before :class:`~.insert_kv_cache.InsertKVCachePass`. Each op, in
graph order, numbered per kind, gets

- an input ``past_conv_state.{i}`` (B, C, K − 1) or ``past_recurrent_state.{i}`` (B, H, d_k,
  d_v) in its ``past_state`` slot (roles ``past_conv_state`` / ``past_recurrent_state`` of
  layer i, :mod:`tfgraph.contract`);
- its second output, the state after the new tokens, as the graph output
  ``present_conv_state.{i}`` / ``present_recurrent_state.{i}``; the op gets ``cached=1``.

A state has a fixed size whatever the past (the whole point of a recurrent layer): the runner
starts from zeros, which is what the op computes without a past, and feeds each present back.
One graph serves prefill and decode, as with the KV cache. An op whose state dims are not
static is refused with a :class:`RecurrentStateError` naming the layer.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from tfgraph import contract
from tfgraph.passes.canonical import RECURRENT_OPS, CausalConvOp, LinearAttentionOp, is_canonical
from tfgraph.passes.provenance import layer_name
from tfgraph.passes.rewrite_utils import dims_of

logger = logging.getLogger(__name__)


class RecurrentStateError(ValueError):
    """A recurrent layer whose state cannot be carried; the message names the layer."""


def recurrent_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if is_canonical(n) and n.op_type in RECURRENT_OPS]


def _static(node: ir.Node, value: ir.Value, axis: int, what: str) -> int:
    dims = dims_of(value) if value is not None and value.shape is not None else []
    if not dims or not isinstance(dims[axis], int):
        raise RecurrentStateError(
            f"{layer_name(node)}: the {what} is not static, so the state's size is unknown"
        )
    return dims[axis]


def _state_shape(node: ir.Node) -> tuple[list, str, str]:
    """(state dims, past role, present role) of one canonical recurrent op."""
    x = node.inputs[0]
    batch = dims_of(x)[0] if x.shape is not None else "batch"
    if node.op_type == CausalConvOp.OP:
        channels = _static(node, node.inputs[1], 0, "convolution's channel count")
        width = _static(node, node.inputs[1], -1, "convolution's kernel size")
        return [batch, channels, width - 1], contract.PAST_CONV_STATE, contract.PRESENT_CONV_STATE
    spec = LinearAttentionOp.read(node)
    heads = spec.kv_num_heads
    dk = _static(node, node.inputs[1], -1, "key width") // heads
    dv = _static(node, node.inputs[2], -1, "value width") // heads
    return [batch, heads, dk, dv], contract.PAST_RECURRENT_STATE, contract.PRESENT_RECURRENT_STATE


class InsertRecurrentStatePass(ir.passes.InPlacePass):
    """Give every canonical recurrent op a past/present state (see the module docstring);
    ``modified`` is False for a graph without any, or with its states already in."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        nodes = recurrent_nodes(model)
        if not nodes or contract.names_with_role(model, *contract.STATE_ROLES):
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        counts: dict[str, int] = {}
        for node in nodes:
            dims, past_role, present_role = _state_shape(node)
            i = counts.get(past_role, 0)
            counts[past_role] = i + 1
            past = ir.Value(
                name=contract.tensor_name(past_role, i),
                type=ir.TensorType(node.inputs[0].dtype or ir.DataType.FLOAT),
                shape=ir.Shape(dims),
            )
            graph.inputs.append(past)
            contract.set_role(model, past.name, past_role, i)
            slot = RECURRENT_OPS[node.op_type].PAST_STATE
            if len(node.inputs) <= slot:
                node.resize_inputs(slot + 1)
            node.replace_input_with(slot, past)
            present = node.outputs[1]
            present.name = contract.tensor_name(present_role, i)
            present.type, present.shape = past.type, ir.Shape(dims)
            graph.outputs.append(present)
            contract.set_role(model, present.name, present_role, i)
            spec = RECURRENT_OPS[node.op_type].read(node)
            spec.replace(cached=True).write(node)
        logger.info("recurrent state carried for %s", counts)
        return ir.passes.PassResult(model, modified=True)
