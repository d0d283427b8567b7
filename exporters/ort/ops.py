"""ONNX Runtime's contrib ops (``com.microsoft``) that tfgraph writes or reads: their names live
here, in the ``ort`` target's folder, and in its runner only. Code elsewhere that must tell an
ORT kernel from a standard op asks this module (or the target object), never spells the name."""

from __future__ import annotations

MS_DOMAIN = "com.microsoft"

GROUP_QUERY_ATTENTION = "GroupQueryAttention"
MULTI_HEAD_ATTENTION = "MultiHeadAttention"
ATTENTION = "Attention"  # com.microsoft.Attention (packed QKV, BERT-style)
PAGED_ATTENTION = "PagedAttention"
ROTARY_EMBEDDING = "RotaryEmbedding"
SKIP_LAYER_NORM = "SkipLayerNormalization"
SKIP_SIMPLIFIED_LAYER_NORM = "SkipSimplifiedLayerNormalization"
SIMPLIFIED_LAYER_NORM = "SimplifiedLayerNormalization"  # ONNX domain, ORT-only kernel
GELU = "Gelu"  # com.microsoft.Gelu
FAST_GELU = "FastGelu"
BIAS_GELU = "BiasGelu"
MATMUL_NBITS = "MatMulNBits"
GATHER_BLOCK_QUANTIZED = "GatherBlockQuantized"
DYNAMIC_QUANTIZE_MATMUL = "DynamicQuantizeMatMul"
LINEAR_ATTENTION = "LinearAttention"
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
