"""``ort``: ONNX Runtime on the CPU, with its contrib kernels (``com.microsoft``).

Choices measured on ONNX Runtime 1.32's CPU provider (docs/attention-lowering.md,
KERNELS.md). "Self" means S == T is proved by the shapes; then both causal alignments coincide.

Attention:

1. cached layer (the KV-cache pass's past + new), causal, bottom-right, head size a multiple
   of 8: ``GroupQueryAttention`` with ``past_key``/``past_value`` (it appends the new keys and
   values itself; with the shared buffer, in place).
2. self, causal: ``GroupQueryAttention`` (``causal=1``; KV heads native;
   ``local_window_size = window``; the bias, if any, as ``attention_bias`` with its query axis
   expanded to T). It takes its flash path only with ``present_*`` declared (done).
3. self, not causal, with a bias, a window or a softcap: ``GroupQueryAttention`` with
   ``causal=0``, the window folded into ``attention_bias`` (measured: ``softcap`` with
   ``causal=0`` and no bias is exact too).
4. not causal, no bias, no window (self or cross): ``MultiHeadAttention`` (its flash path on the
   CPU), K/V heads expanded by repeat-interleave when Hkv < Hq.
5. S ≠ T (or not provable) with causal, window or bias, or a head size GQA's CPU kernel refuses
   (not a multiple of 8): ``MultiHeadAttention`` with the masks folded into
   ``attention_bias`` (GQA rejects S ≠ T without a past; ``MultiHeadAttention(unidirectional=1)``
   is wrong for 1 < T < S; ``Attention``-23 with a mask measured no better).
6. a softcap where ``GroupQueryAttention`` does not apply (S ≠ T: it refuses a key length
   other than the query's without a past, and a past with T > 1 unless B = 1; or a head
   size it refuses): ONNX ``Attention``-23 at opset ≥ 23 (its CPU kernel applies the tanh
   before ``attn_mask``, as canonical: measured); below opset 23 the standard ops, reported
   (``MultiHeadAttention`` has no softcap).

Norms: ``LayerNormalization``; RMSNorm as ``SkipSimplifiedLayerNormalization`` where it reads a
residual ``Add`` (else ``SimplifiedLayerNormalization``): on a ~120M Llama (2 threads) the
decode step went from 12.2 to 11.5 ms, prefill at 512 within noise, 172 → 148 nodes, as the
onnxruntime-genai builder's graph. No skip kernel for LayerNorm:
on the CPU (ORT 1.32, 2 threads, (1, 512, 768)) ``SkipLayerNormalization`` took 1.14 ms where
``Add`` + ``LayerNormalization`` took 0.20 ms (``ort-cuda`` uses them). ONNX Runtime's own
``SkipLayerNormFusion`` would make one from a residual ``Add`` feeding only the norm, in any
session opened with default options; the norm reads such an ``Add`` through a no-op
``Reshape`` the fusion does not match (``NormCase.layer_normalization``), so a plain
``onnxruntime.InferenceSession`` runs the fast kernels without any option.
GELU: ``com.microsoft`` ``Gelu`` / ``FastGelu``.
"""

from __future__ import annotations

import onnx_ir.passes.common as common

from tfgraph.exporters.ort import ops
from tfgraph.exporters.ort.attention_gqa import gqa, gqa_past
from tfgraph.exporters.ort.attention_mha import mha, mha_sink
from tfgraph.exporters.ort.fold_rotary import FoldRotaryPass
from tfgraph.exporters.ort.gelu import ms_gelu
from tfgraph.exporters.ort.kernel_layouts import KernelLayoutsPass
from tfgraph.exporters.ort.norms import simplified, skip
from tfgraph.exporters.ort.pack_qkv import PackQKVPass
from tfgraph.exporters.ort.recurrent import contrib_kernel
from tfgraph.exporters.ort.share_kv_buffer import ShareKVBufferPass
from tfgraph.exporters.target import SessionSettings, Target, fused_ops
from tfgraph.exporters.targets import register
from tfgraph.passes.lower.expand_attention_mask import ExpandAttentionMaskPass
from tfgraph.passes.lower.lower_attention import AttentionCase, Lowered
from tfgraph.passes.lower.lower_norms import NormCase

MS = ops.MS_DOMAIN
ORT_FUSED = {
    "attention": {
        (MS, ops.ATTENTION),
        (MS, ops.MULTI_HEAD_ATTENTION),
        (MS, ops.GROUP_QUERY_ATTENTION),
        (MS, ops.PAGED_ATTENTION),  # ort-cuda, --kv-layout paged
    },
    "norm": {
        ("", ops.SIMPLIFIED_LAYER_NORM),
        (MS, ops.SIMPLIFIED_LAYER_NORM),
        (MS, ops.SKIP_LAYER_NORM),
        (MS, ops.SKIP_SIMPLIFIED_LAYER_NORM),
    },
    "recurrent": {
        (MS, ops.LINEAR_ATTENTION),
        (MS, ops.CAUSAL_CONV_WITH_STATE),
    },
    "gelu": {
        (MS, ops.GELU),
        (MS, ops.FAST_GELU),
        (MS, ops.BIAS_GELU),
    },
}


ATTENTION23_OPSET = 23  # ONNX Attention, which ORT 1.32 runs on the CPU


def lower_attention(case: AttentionCase) -> Lowered:
    spec, build = case.spec, case.build
    # GroupQueryAttention's CPU kernel needs head_size % 8 == 0 (measured: it refuses
    # Llama-2-70B-tiny's head size 2); MultiHeadAttention with the mask does not.
    # Its past/present and output also take one head size for Q, K and V (MLA's narrower V
    # heads are refused at run time: "INVALID_ARGUMENT … GroupQueryAttention").
    gqa_ok = (
        isinstance(case.head_size, int)
        and case.head_size % 8 == 0
        and case.v_head_size == case.head_size
    )
    sink = case.sink
    cached = case.cached_kv() if gqa_ok and spec.causal and spec.bottom_right else None
    if cached is not None:
        y = gqa_past(build, cached, case.bias, spec, sink)
        return Lowered(y, "GroupQueryAttention (past)")
    # what MultiHeadAttention cannot do: a mask it would need as a bias, a softcap, a sink
    needs_gqa = spec.causal or spec.window or case.bias is not None or sink is not None
    if gqa_ok and case.self_attention and (needs_gqa or spec.softcap):
        return Lowered(gqa(build, case.v, case.bias, spec, sink), "GroupQueryAttention")
    if spec.softcap and sink is None and case.opset >= ATTENTION23_OPSET:
        # measured on ORT 1.32's CPU kernel: its tanh comes before attn_mask, as canonical
        return Lowered(build.attention23(case.v, case.bias, spec), "Attention")
    if sink is not None and not spec.softcap:  # MultiHeadAttention, the sink as a zero key
        return Lowered(mha_sink(build, case.v, case.bias, spec, sink), "MultiHeadAttention (sink)")
    for present, what in ((spec.softcap, "softcap"), (sink is not None, "attention-sink input")):
        if present:  # MultiHeadAttention has neither: the standard ops, reported
            reason = (
                f"MultiHeadAttention has no {what}, and GroupQueryAttention does not apply here"
                + (
                    f" (S ≠ T{'' if gqa_ok else ' or a head size it refuses'}; ONNX "
                    f"Attention-{ATTENTION23_OPSET} takes a softcap: --opset "
                    f"{ATTENTION23_OPSET})"
                    if what == "softcap"
                    else ""
                )
            )
            return Lowered(build.decomposed(case.v, case.bias, spec, sink), "decomposed", reason)
    mask = build.full_mask(case.bias, spec, causal=spec.causal, window=spec.window)
    return Lowered(mha(build, case.v, mask, spec), "MultiHeadAttention")


def lower_norm(case: NormCase) -> Lowered:
    if case.rms:  # the residual Add inside the kernel: one node fewer per norm (measured)
        return skip(case) or simplified(case)
    return case.layer_normalization(keep_residual_apart=True)


def lower_norm_with_skip(case: NormCase) -> Lowered:
    """ONNX Runtime's skip kernels where the norm reads a residual ``Add`` (``ort-cuda``)."""
    fused = skip(case)
    if fused is not None:
        return fused
    return simplified(case) if case.rms else case.layer_normalization()


ROTARY_HEAD_MULTIPLE = 16  # GroupQueryAttention do_rotary on the CPU provider


def extra_passes(options) -> list:
    passes = []
    # GQA appends in place into buffers past and present share (unless a growing past is asked)
    if options.kv_cache and options.kv_layout == "shared":
        passes.append(ShareKVBufferPass())
    # RoPE inside GroupQueryAttention; no layout round trips around the kernels; one packed
    # Q/K/V projection; the layers' identical length subgraphs merged
    passes += [
        # measured on ORT 1.32: rotary needs "head_size shall be a multiple of 16"
        FoldRotaryPass(options.max_positions, head_multiple=ROTARY_HEAD_MULTIPLE),
        KernelLayoutsPass(),
        common.RemoveUnusedNodesPass(),  # the bypassed layouts still read the projections
        PackQKVPass(),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
    ]
    # ORT's Attention kernel rejects a mask broadcast over the query axis (an unrecognized
    # ONNX Attention left in the graph)
    passes.append(ExpandAttentionMaskPass())
    return passes


ORT = register(
    Target(
        name="ort",
        description="ONNX Runtime, CPU provider: contrib kernels (GroupQueryAttention flash path)",
        opset=20,  # ORT's contrib ops need nothing newer
        lower_attention=lower_attention,
        lower_norm=lower_norm,
        lower_gelu=ms_gelu,
        fused_ops=fused_ops(ORT_FUSED),
        extra_passes=extra_passes,
        lower_recurrent=contrib_kernel,
        nonstandard_default_ops=frozenset({ops.SIMPLIFIED_LAYER_NORM}),
        session=SessionSettings(providers=("cpu",)),
        runner="onnxruntime",
        row_lengths=True,  # GroupQueryAttention's seqlens_k is per row
        kv_dtypes=("int8",),  # GroupQueryAttention's kv_cache_bit_width=8
        kv_scales=("per-tensor", "per-channel"),
        precisions=("fp32", "fp16"),
        weight_formats=("int8", "int4"),  # com.microsoft.MatMulNBits
        # level 4: int8 activations per block, 2-35x faster than level 0 here (docs/precision.md)
        weight_accuracy_levels=(4, 0),
        facts=(
            "GroupQueryAttention: flash path on the CPU (O(n) memory) with present_* declared",
            "head size must be a multiple of 8 for GroupQueryAttention; else MultiHeadAttention",
            "KV cache: one preallocated buffer per layer shared by past and present",
            "LinearAttention (4 update rules) and CausalConvWithState: CPU kernels in ORT 1.32",
        ),
    )
)
