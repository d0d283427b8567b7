"""Tell a gate's softmax (a mixture-of-experts router, a CTC head) from attention's: the
attention rules (:mod:`.fuse`, :mod:`.separable`) skip it, and the KV
cache pass (:mod:`.insert_kv_cache`) does not count it as an unfused attention core."""

from __future__ import annotations

import onnx_ir as ir

from tfgraph.passes.rewrite_utils import constant

_THROUGH = frozenset({"Add", "Sub", "Mul", "Div", "Cast", "Identity", "Neg", "Tanh", "Where"})


def is_gating_softmax(node: ir.Node) -> bool:
    """A ``Softmax`` over a projection, not over attention scores: a mixture-of-experts
    router's ``softmax(x · W_router)`` (or any gate; Granite Speech 5's self-conditioned CTC
    posteriors ``softmax(x · W_ctcᵀ)`` over the vocabulary). Its input comes, through
    elementwise ops (and the values of a ``TopK``), from a ``MatMul``/``Gemm`` by a constant
    2-D weight (or a transpose or cast of one: a tied weight), and
    its axis has a static size (the experts; ConvBERT's dynamic-convolution kernel, reshaped
    first), where attention scores come from ``Q · Kᵀ`` of two activations over keys. Such a
    softmax is not an attention candidate: not fused, not reported missed."""
    value = node.inputs[0]
    if value is None or value.shape is None or not value.shape:
        return False
    axis = node.attributes.get_int("axis", -1)
    if not -len(value.shape) <= axis < len(value.shape):
        return False
    if not isinstance(value.shape[axis], int):  # over a dynamic axis: keys, not experts
        return False
    for _ in range(6):
        producer = value.producer()
        if producer is None or producer.domain not in ("", "ai.onnx"):
            return False
        if producer.op_type in ("MatMul", "Gemm"):
            weight = _constant_through_views(producer.inputs[1])
            return weight is not None and weight.ndim == 2
        if producer.op_type == "TopK":  # a softmax over the top-k experts' logits (Aria)
            value = producer.inputs[0]
            continue
        if producer.op_type == "Reshape":  # ConvBERT's dynamic convolution: a kernel of
            value = producer.inputs[0]  # static size per position, reshaped to (-1, k, 1)
            continue
        if producer.op_type in ("ScatterElements", "ScatterND"):  # experts masked out of the
            value = producer.inputs[0]  # logits (PhiMoE's sparse mixer: the top-1 set to -inf)
            continue
        if producer.op_type not in _THROUGH:
            return False
        data = [i for i in producer.inputs if i is not None and constant(i) is None]
        if producer.op_type == "Where":
            data = data[1:]
        if len(data) != 1:
            return False
        value = data[0]
    return False


_WEIGHT_VIEWS = frozenset({"Transpose", "Cast", "Identity"})


def _constant_through_views(value: ir.Value | None):
    """A constant, or a transpose or cast of one: a weight shared with another layer (a tied
    CTC head, Granite Speech 5's self-conditioned posteriors) stays ``Transpose(W)``."""
    for _ in range(3):
        array = constant(value)
        if array is not None or value is None:
            return array
        producer = value.producer()
        if producer is None or producer.op_type not in _WEIGHT_VIEWS:
            return None
        if producer.domain not in ("", "ai.onnx"):
            return None
        value = producer.inputs[0]
    return constant(value)
