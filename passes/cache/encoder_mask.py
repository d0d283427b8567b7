"""An encoder mask for the cross-attention of an encoder-decoder that takes none.

In-flight batching (:mod:`tfgraph.runtime.inflight`) keeps each request's cross-attention keys
and values in its slot, padded to the slot's encoder capacity: the step graph must mask the
padding. A model traced without an ``attention_mask`` input (Hugging Face T5 and BART as
tfgraph loads them from a directory take only ``input_ids`` and ``decoder_input_ids``) has no
mask to do it with. :func:`add_encoder_mask` gives every cross-attention a key-padding bias
from a new input ``encoder_slot_mask`` (role ``encoder_slot_mask``, (batch, encoder_sequence)
int64, 1 for a position the slot's request has): the bias the classifier builds from a mask
input (:func:`.key_padding_bias.build_key_bias`), added to any bias the layer had. Only the
step graph reads it (the encoder file does not: a slot's encoder runs on its prompt alone).

It is a role of its own, not ``encoder_attention_mask``: the model as written attends to
every encoder position, padding included, so ``generate`` over left-padded prompts feeds it
ones and computes what eager PyTorch computes; only a slot, whose padding is the slot's and
not the request's, feeds zeros. Added for a text encoder (its input has role
``encoder_token_ids``); a speech encoder-decoder is not batched in flight anyway.

Called by :class:`~.insert_kv_cache.InsertKVCachePass` with per-row lengths, after the cross
K/V are named (their names find the cross-attentions).
"""

from __future__ import annotations

import json
import logging

import onnx_ir as ir

from tfgraph import contract
from tfgraph.passes.cache.split_encoder import CROSS_KV_KEY
from tfgraph.passes.canonical import DOMAIN, AttentionOp
from tfgraph.passes.recognize.attention.key_padding_bias import build_key_bias

logger = logging.getLogger(__name__)

BIAS_SLOT = AttentionOp.BIAS
NAME = "encoder_slot_mask"


def add_encoder_mask(model: ir.Model) -> int:
    """Mask every cross-attention's keys with a new encoder-mask input, where the model has
    cross-attention and no such input; the number of layers masked."""
    if contract.names_with_role(model, contract.ENCODER_ATTENTION_MASK):
        return 0
    tokens = contract.names_with_role(model, contract.ENCODER_TOKEN_IDS)
    encoder = next((v for v in model.graph.inputs if v.name in tokens), None)
    if encoder is None or encoder.shape is None or len(encoder.shape) != 2:
        return 0
    entries = json.loads(model.metadata_props.get(CROSS_KV_KEY, "[]"))
    cross = {name for name, role, _ in entries if role == contract.CROSS_KEY}
    nodes = [
        n
        for n in model.graph
        if n.domain == DOMAIN and n.op_type == "Attention" and n.inputs[1].name in cross
    ]
    if not nodes:
        return 0
    name = NAME
    keys = nodes[0].inputs[1]
    if name in {v.name for v in model.graph.inputs} or keys.shape is None or len(keys.shape) != 4:
        logger.info("no encoder mask added: no free input name or the keys' shape is unknown")
        return 0
    # the encoder tokens' shape (its dims named as the graph names them: the keys' length
    # may carry a name of its own, and a probe would size the two apart)
    mask = ir.Value(
        name=name, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(list(encoder.shape))
    )
    model.graph.inputs.append(mask)
    contract.set_role(model, name, contract.ENCODER_SLOT_MASK)
    built: dict[ir.DataType | None, ir.Value] = {}
    for node in nodes:
        dtype = node.inputs[0].dtype
        if dtype not in built:
            built[dtype] = build_key_bias(model.graph, node, mask, dtype)
        bias = built[dtype]
        old = node.inputs[BIAS_SLOT] if len(node.inputs) > BIAS_SLOT else None
        spec = AttentionOp.read(node)
        if old is not None:
            added = ir.node("Add", [old, bias])
            added.outputs[0].type = old.type
            model.graph.insert_before(node, added)
            bias = added.outputs[0]
        else:
            spec = spec.replace(bias_kind="padding")
        if len(node.inputs) <= BIAS_SLOT:
            node.resize_inputs(BIAS_SLOT + 1)
        node.replace_input_with(BIAS_SLOT, bias)
        spec.write(node)
    logger.info("encoder mask '%s' added for %d cross-attention layer(s)", name, len(nodes))
    return len(nodes)
