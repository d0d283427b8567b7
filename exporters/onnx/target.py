"""``onnx``: standard ONNX only (opset 23): any runtime that implements the standard.

- Attention → ``Attention``-23 on the 4-D inputs (Hkv < Hq native), ``scale``;
  ``is_causal=1`` when causal, no window, and top-left or self (without a past, ONNX's
  ``is_causal`` is top-left); otherwise the causal/window mask is built from shapes and added
  to the bias as ``attn_mask``, whose query axis is always T (ORT rejects a broadcast one).
  Below opset 23: the decomposed standard ops, reported as missed with the reason.
- LayerNorm → ``LayerNormalization``; RMSNorm → ``RMSNormalization`` (opset 23; below it,
  decomposed and reported).
- GELU → ``Gelu``-20 (below opset 20, its formula, reported).
"""

from __future__ import annotations

from tfgraph.exporters.onnx.static_kv_cache import StaticKVCachePass
from tfgraph.exporters.target import SessionSettings, Target, fused_ops
from tfgraph.exporters.targets import register
from tfgraph.passes.lower.expand_attention_mask import ExpandAttentionMaskPass
from tfgraph.passes.lower.lower_attention import AttentionCase, Lowered
from tfgraph.passes.lower.lower_gelu import standard_gelu
from tfgraph.passes.lower.lower_norms import NormCase

ATTENTION_OPSET = 23


SINK_MISS = "ONNX Attention has no attention-sink input"


def lower_attention(case: AttentionCase) -> Lowered:
    if case.sink is not None:
        y = case.build.decomposed(case.v, case.bias, case.spec, case.sink)
        return Lowered(y, "decomposed", SINK_MISS)
    if case.opset >= ATTENTION_OPSET:
        return Lowered(case.build.attention23(case.v, case.bias, case.spec), "Attention")
    reason = f"ONNX Attention needs opset {ATTENTION_OPSET}; this graph is opset {case.opset}"
    return Lowered(case.build.decomposed(case.v, case.bias, case.spec), "decomposed", reason)


def lower_norm(case: NormCase) -> Lowered:
    if not case.rms:
        return case.layer_normalization()
    if case.opset >= 23:
        return case.rms_normalization()
    return case.decomposed(f"RMSNormalization needs opset 23; this graph is opset {case.opset}")


def extra_passes(options) -> list:
    # ORT, which verifies these graphs, rejects an Attention mask broadcast over the query axis
    # TensorScatter-24 buffers (unless a growing past is asked: the optimum flavour)
    shared = options.kv_layout == "shared"
    static = [StaticKVCachePass()] if options.kv_cache and shared else []
    return [*static, ExpandAttentionMaskPass()]


register(
    Target(
        name="onnx",
        description="standard ONNX (opset 23): Attention-23, RMSNormalization, Gelu-20",
        opset=23,
        lower_attention=lower_attention,
        lower_norm=lower_norm,
        lower_gelu=standard_gelu,
        fused_ops=fused_ops(),
        extra_passes=extra_passes,
        session=SessionSettings(providers=("cpu",)),
        runner="onnxruntime",
        row_lengths=True,  # TensorScatter-24 writes each row at its own index
        kv_dtypes=("int8",),  # QuantizeLinear before TensorScatter, DequantizeLinear after
        precisions=("fp32", "fp16", "bf16"),
        # ONNX Runtime has no bf16 kernels on the CPU: ONNX's reference evaluator verifies them
        precision_runners={"bf16": "onnx-reference"},
        facts=("verified with ONNX Runtime's CPU provider",),
    )
)
