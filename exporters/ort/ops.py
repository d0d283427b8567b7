"""ONNX Runtime's contrib ops (``com.microsoft``) that tfgraph writes or reads: their names live
here, in the ``ort`` target's folder, and in its runner only. Code elsewhere that must tell an
ORT kernel from a standard op asks this module (or the target object), never spells the name.

Checked against ONNX Runtime 1.32's operator schemas: every name below is a ``com.microsoft``
op except ``SimplifiedLayerNormalization``, which ORT registers in the default domain (ONNX
has no such op). Some share a name with a standard op that tfgraph does not mean here:
ONNX ``Attention``-23, ``Gelu``-20, ``RotaryEmbedding``-23, and ``LinearAttention`` /
``CausalConvWithState`` of opset 27; and ``tfgraph.LinearAttention`` is tfgraph's own canonical
op (:mod:`tfgraph.passes.canonical`), which the ``ort`` target lowers to the contrib one.
"""

from __future__ import annotations

MS_DOMAIN = "com.microsoft"

GROUP_QUERY_ATTENTION = "GroupQueryAttention"
MULTI_HEAD_ATTENTION = "MultiHeadAttention"
ATTENTION = "Attention"  # com.microsoft.Attention (packed QKV, BERT-style)
PAGED_ATTENTION = "PagedAttention"
ROTARY_EMBEDDING = "RotaryEmbedding"
SKIP_LAYER_NORM = "SkipLayerNormalization"
SKIP_SIMPLIFIED_LAYER_NORM = "SkipSimplifiedLayerNormalization"
SIMPLIFIED_LAYER_NORM = "SimplifiedLayerNormalization"  # default domain, ORT-only kernel
GELU = "Gelu"  # com.microsoft.Gelu
FAST_GELU = "FastGelu"
BIAS_GELU = "BiasGelu"
MATMUL_NBITS = "MatMulNBits"
GATHER_BLOCK_QUANTIZED = "GatherBlockQuantized"
DYNAMIC_QUANTIZE_MATMUL = "DynamicQuantizeMatMul"
LINEAR_ATTENTION = "LinearAttention"  # com.microsoft (CPU kernel in ORT 1.32)
CAUSAL_CONV_WITH_STATE = "CausalConvWithState"

ATTENTION_KERNELS = frozenset(
    {GROUP_QUERY_ATTENTION, MULTI_HEAD_ATTENTION, ATTENTION, PAGED_ATTENTION}
)
QUANTIZED_WEIGHT_OPS = frozenset({MATMUL_NBITS, GATHER_BLOCK_QUANTIZED})


def is_ms(node) -> bool:
    """Is ``node`` (an ``onnx_ir`` or ``onnx`` node) one of ONNX Runtime's contrib ops?"""
    return node.domain == MS_DOMAIN


def is_op(node, op_type: str) -> bool:
    """``node`` is ``com.microsoft.<op_type>``."""
    return node.domain == MS_DOMAIN and node.op_type == op_type
