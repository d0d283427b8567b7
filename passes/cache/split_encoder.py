"""Split a KV-cached encoder-decoder graph: the encoder runs once, the decoder every step.

:class:`~.insert_kv_cache.InsertKVCachePass` names the key and value of every cross-attention
``cross_key_values.{i}.key`` / ``.value`` (batch, heads, encoder_sequence, head_dim) by decoder
layer i, and lists them in the model's metadata (:data:`CROSS_KV_KEY`, ``[name, role, layer]``
entries). :func:`split_encoder` then cuts the graph there:

- the **encoder** graph (``onnx_ir``'s ``extract``) takes the encoder inputs and returns only
  those cross keys and values (roles ``cross_key`` / ``cross_value`` of decoder layer i);
- the **decoder** graph takes them as inputs instead of recomputing them, so a decoding step
  never runs the encoder; encoder inputs it no longer reads are dropped (an
  ``attention_mask`` it still reads for the cross-attention mask stays).
"""

from __future__ import annotations

import json
import logging

import onnx_ir as ir
import onnx_ir.passes.common as common

from tfgraph import contract
from tfgraph.passes.rewrite_utils import dims_of

logger = logging.getLogger(__name__)

CROSS_KV_KEY = "tfgraph.cross_kv"


def cross_kv_entries(model: ir.Model) -> list[tuple[str, str, int]]:
    return [tuple(e) for e in json.loads(model.metadata_props.get(CROSS_KV_KEY, "[]"))]


def _drop_unused_inputs(model: ir.Model) -> None:
    graph = model.graph
    dropped = []
    for value in list(graph.inputs):
        if not value.uses() and not value.is_graph_output():
            graph.inputs.remove(value)
            dropped.append(value.name)
    contract.drop_roles(model, dropped)


def split_encoder(model: ir.Model) -> ir.Model | None:
    """Turn ``model`` into the decoder step graph in place and return the encoder graph, or
    ``None`` when the model has no cross-attention to cut."""
    entries = cross_kv_entries(model)
    if not entries:
        return None
    names = [name for name, _, _ in entries]
    values = ir.convenience.create_value_mapping(model.graph)
    roles = contract.read_roles(model.metadata_props)
    graph = ir.convenience.extract(
        model.graph, list(model.graph.inputs), [values[n] for n in names]
    )
    encoder = ir.Model(graph, ir_version=model.ir_version, producer_name=model.producer_name)
    contract.write_roles(encoder, {v.name: roles[v.name] for v in graph.inputs if v.name in roles})
    for name, role, layer in entries:
        contract.set_role(encoder, name, role, layer)
    _shapes_from_encoder_inputs(encoder)
    common.RemoveUnusedNodesPass()(encoder)
    _drop_unused_inputs(encoder)
    common.RemoveUnusedOpsetsPass()(encoder)

    for name in names:
        old = values[name]
        new = ir.Value(name=f"{name}__input", type=old.type, shape=old.shape)
        model.graph.inputs.append(new)
        old.replace_all_uses_with(new)
    common.RemoveUnusedNodesPass()(model)
    for value in model.graph.inputs:
        if value.name.endswith("__input"):
            value.name = value.name[: -len("__input")]
    for name, role, layer in entries:
        contract.set_role(model, name, role, layer)
    _drop_unused_inputs(model)
    common.RemoveUnusedOpsetsPass()(model)
    model.metadata_props.pop(CROSS_KV_KEY, None)
    logger.info("split off the encoder: %d cross-attention layers", len(names) // 2)
    return encoder


def _shapes_from_encoder_inputs(model: ir.Model) -> None:
    """Cross K/V often read the batch size off the decoder's tokens (``Shape`` of a decoder
    value, for a ``Reshape``). Take such dims from an encoder input with the same symbol, so
    the encoder graph does not need the decoder's tokens."""
    graph = model.graph
    tokens = set(contract.names_with_role(model, contract.TOKEN_IDS))
    decoder_inputs = [v for v in graph.inputs if v.name in tokens]
    if not decoder_inputs:
        return
    sources = {}  # symbol → (encoder input, axis)
    masks = set(contract.names_with_role(model, contract.ATTENTION_MASK))
    # a mask last: an encoder reading only its shape would need it fed (Mllama's cross K/V
    # take the batch from the decoder's mask, and the image features hold it too)
    for value in sorted(graph.inputs, key=lambda v: v.name in masks):
        for axis, dim in enumerate(dims_of(value) or []):
            if isinstance(dim, str) and value not in decoder_inputs:
                sources.setdefault(dim, (value, axis))
    reached = set(decoder_inputs)
    for node in list(graph):
        if not any(v in reached for v in node.inputs if v is not None):
            continue
        if node.op_type != "Shape":
            reached.update(node.outputs)
            continue
        dims = dims_of(node.inputs[0])
        if dims is None:
            continue
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", len(dims))
        picked = dims[slice(start, end)]
        if not picked or not all(isinstance(d, str) and d in sources for d in picked):
            continue
        parts = []
        for dim in picked:
            value, axis = sources[dim]
            part = ir.node("Shape", [value], {"start": axis, "end": axis + 1})
            graph.insert_before(node, part)
            parts.append(part.outputs[0])
        if len(parts) > 1:
            concat = ir.node("Concat", parts, {"axis": 0})
            graph.insert_before(node, concat)
            parts = concat.outputs
        node.outputs[0].replace_all_uses_with(parts[0])
