"""Split a KV-cached encoder-decoder graph: the encoder runs once, the decoder every step.

:class:`~.insert_kv_cache.InsertKVCachePass` names the key and value of every cross-attention
layer ``cross_key_values.{i}.key`` / ``.value`` (batch, heads, encoder_sequence, head_dim) and
lists them in the model's metadata (:data:`CROSS_KV_KEY`). :func:`split_encoder` then cuts the
graph there:

- the **encoder** graph takes the encoder inputs and returns those cross keys and values;
- the **decoder** graph takes them as inputs instead of recomputing them, so a decoding step
  never runs the encoder; encoder inputs it no longer reads are dropped (an
  ``attention_mask`` it still reads for the cross-attention mask stays).
"""

from __future__ import annotations

import json
import logging

import onnx_ir as ir
import onnx_ir.passes.common as common

logger = logging.getLogger(__name__)

CROSS_KV_KEY = "tfgraph.cross_kv"
CROSS_KEY, CROSS_VALUE = "cross_key_values.{}.key", "cross_key_values.{}.value"


def cross_kv_names(model: ir.Model) -> list[str]:
    return json.loads(model.metadata_props.get(CROSS_KV_KEY, "[]"))


def _values_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    values = {v.name: v for v in graph.inputs}
    for node in graph:
        values.update({v.name: v for v in node.outputs if v.name})
    return values


def _drop_unused_inputs(graph: ir.Graph) -> None:
    for value in list(graph.inputs):
        if not value.uses() and not value.is_graph_output():
            graph.inputs.remove(value)


def split_encoder(model: ir.Model) -> ir.Model | None:
    """Turn ``model`` into the decoder step graph in place and return the encoder graph, or
    ``None`` when the model has no cross-attention to cut."""
    names = cross_kv_names(model)
    if not names:
        return None
    encoder = ir.serde.deserialize_model(ir.serde.serialize_model(model))  # a deep copy
    values = _values_by_name(encoder.graph)
    encoder.graph.outputs.clear()
    encoder.graph.outputs.extend(values[n] for n in names)
    common.RemoveUnusedNodesPass()(encoder)
    _drop_unused_inputs(encoder.graph)
    _shapes_from_encoder_inputs(encoder.graph)
    common.RemoveUnusedNodesPass()(encoder)
    _drop_unused_inputs(encoder.graph)
    common.RemoveUnusedOpsetsPass()(encoder)
    encoder.metadata_props.pop(CROSS_KV_KEY, None)

    values = _values_by_name(model.graph)
    for name in names:
        old = values[name]
        new = ir.Value(name=f"{name}__input", type=old.type, shape=old.shape)
        model.graph.inputs.append(new)
        old.replace_all_uses_with(new)
    common.RemoveUnusedNodesPass()(model)
    for value in model.graph.inputs:
        if value.name.endswith("__input"):
            value.name = value.name[: -len("__input")]
    _drop_unused_inputs(model.graph)
    common.RemoveUnusedOpsetsPass()(model)
    model.metadata_props.pop(CROSS_KV_KEY, None)
    logger.info("split off the encoder: %d cross-attention layers", len(names) // 2)
    return encoder


def _dims(value: ir.Value) -> list | None:
    if value.shape is None:
        return None
    return [d.value if isinstance(d, ir.SymbolicDim) else d for d in value.shape]


def _shapes_from_encoder_inputs(graph: ir.Graph) -> None:
    """Cross K/V often read the batch size off the decoder's tokens (``Shape`` of a decoder
    value, for a ``Reshape``). Take such dims from an encoder input with the same symbol, so
    the encoder graph does not need the decoder's tokens."""
    decoder_inputs = [v for v in graph.inputs if v.name == "decoder_input_ids"]
    if not decoder_inputs:
        return
    sources = {}  # symbol → (encoder input, axis)
    for value in graph.inputs:
        for axis, dim in enumerate(_dims(value) or []):
            if isinstance(dim, str) and value not in decoder_inputs:
                sources.setdefault(dim, (value, axis))
    reached = set(decoder_inputs)
    for node in list(graph):
        if not any(v in reached for v in node.inputs if v is not None):
            continue
        if node.op_type != "Shape":
            reached.update(node.outputs)
            continue
        dims = _dims(node.inputs[0])
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
