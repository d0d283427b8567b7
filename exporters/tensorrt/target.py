"""``tensorrt``: graphs TensorRT's ONNX parser takes, at a stated TensorRT version
(``tensorrt@10.14``; plain ``tensorrt`` is 10.15).

- Attention → the standard ops TensorRT fuses into its own MHA kernel, scale folded into Q
  (``Q·s → MatMul → Add(mask) → Softmax → MatMul``); counted as fused. TensorRT parses ONNX
  ``Attention`` from 10.14 but with one output only (no present K/V), so cached layers keep
  ``Concat(past, new)`` outside the op either way.
- LayerNorm → ``LayerNormalization``; RMSNorm → ``RMSNormalization`` from TensorRT 10.15 on
  (and opset 23), else decomposed and reported with the reason.
- GELU → ``Gelu``-20.
- TensorRT 11 builds strongly typed networks: the precision comes from the ONNX file
  (``strongly_typed`` in ``facts``), 10.x from builder flags.
- No ``com.microsoft`` ops.
- ``--kv-dtype int8``: the static cache's buffers in int8, per-tensor ``QuantizeLinear`` before
  ``TensorScatter`` and ``DequantizeLinear`` where the attention computes with them (zero point
  0 of type INT8, fp32 scalar scale); unverified on TensorRT itself (tensorrt_compat).

Nothing here is verified with TensorRT on these machines (it cannot be installed): parity
runs the same graph in ONNX Runtime's CPU provider.
"""

from __future__ import annotations

from tfgraph.exporters.onnx.static_kv_cache import StaticKVCachePass
from tfgraph.exporters.target import SessionSettings, Target, fused_ops
from tfgraph.exporters.targets import register, register_factory
from tfgraph.exporters.tensorrt.compat import check_tensorrt
from tfgraph.passes.lower.expand_attention_mask import ExpandAttentionMaskPass
from tfgraph.passes.lower.lower_attention import AttentionCase, Lowered
from tfgraph.passes.lower.lower_gelu import standard_gelu
from tfgraph.passes.lower.lower_norms import NormCase

DEFAULT_VERSION = (10, 15)
RMS_NORMALIZATION = (10, 15)  # first TensorRT whose parser takes RMSNormalization
FUSED_AS = "MatMul-Softmax-MatMul (TensorRT fuses it)"


SOFTCAP_MISS = (
    "soft-capped scores put a tanh between the MatMuls, which TensorRT's MHA fusion is not "
    "known to take (not verified here)"
)


SINK_MISS = (
    "attention sinks put a Concat and a Slice around the Softmax, which TensorRT's MHA fusion "
    "is not known to take (not verified here)"
)


def lower_attention(case: AttentionCase) -> Lowered:
    y = case.build.decomposed(case.v, case.bias, case.spec, case.sink)
    if case.spec.softcap:
        return Lowered(y, "decomposed", missed=SOFTCAP_MISS)
    if case.sink is not None:
        return Lowered(y, "decomposed", missed=SINK_MISS)
    return Lowered(y, "decomposed", fused_as=FUSED_AS)


def _norm_lowering(version: tuple[int, ...]):
    text = ".".join(map(str, version))

    def lower_norm(case: NormCase) -> Lowered:
        if not case.rms:
            return case.layer_normalization()
        if version < RMS_NORMALIZATION:
            return case.decomposed(f"TensorRT {text} does not parse RMSNormalization (10.15+ does)")
        if case.opset >= 23:
            return case.rms_normalization()
        return case.decomposed(f"RMSNormalization needs opset 23; this graph is opset {case.opset}")

    return lower_norm


def extra_passes(options) -> list:
    # parity runs the graph in ONNX Runtime, which rejects a broadcast Attention mask
    static = [StaticKVCachePass()] if options.kv_cache else []  # TensorScatter-24 buffers
    return [*static, ExpandAttentionMaskPass()]


def tensorrt_target(version: tuple[int, ...] = DEFAULT_VERSION) -> Target:
    strongly_typed = version >= (11,)
    return Target(
        name="tensorrt",
        description="TensorRT's ONNX parser: standard ops it fuses (MatMul-Softmax-MatMul)",
        opset=23,
        lower_attention=lower_attention,
        lower_norm=_norm_lowering(version),
        lower_gelu=standard_gelu,
        fused_ops=fused_ops(),
        extra_passes=extra_passes,
        session=SessionSettings(providers=("tensorrt", "cuda", "cpu")),
        runner="onnxruntime",  # until the TensorRT runner lands; see docs/architecture.md
        precisions=("fp32", "fp16", "bf16"),
        # ONNX Runtime has no bf16 kernels on the CPU: ONNX's reference evaluator verifies them
        precision_runners={"bf16": "onnx-reference"},
        # QuantizeLinear before the static cache's TensorScatter, DequantizeLinear after
        kv_dtypes=("int8",),
        version=tuple(version),
        compatibility=lambda model: [f.as_dict() for f in check_tensorrt(model, tuple(version))],
        facts=(
            f"TensorRT {'.'.join(map(str, version))}",
            "Attention parsed with a single output (no present K/V) from 10.14",
            "RMSNormalization parsed from 10.15",
            "int8 KV cache: per-tensor int8 Q/DQ around the static cache (unverified on TensorRT)",
            "strongly typed networks (precision from the ONNX file)"
            if strongly_typed
            else "precision from builder flags (10.x)",
        ),
    )


register(tensorrt_target())
register_factory("tensorrt", tensorrt_target)
