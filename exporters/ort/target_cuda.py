"""``ort-cuda``: ONNX Runtime's CUDA provider. The ``ort`` lowering, plus the skip kernels
(``SkipLayerNormalization`` / ``SkipSimplifiedLayerNormalization`` folding the residual
``Add``), which measured slower on the CPU and are what ONNX Runtime's CUDA provider fuses.

Not verified on a GPU here: parity of an ``ort-cuda`` export runs these kernels on ONNX
Runtime's CPU provider (they exist there), and ``report.json`` names the provider used.

Opt-in, ``--kv-layout paged``: :func:`tfgraph.exporters.ort.paged_attention.lower_to_paged` pages an
fp16 ``ort-cuda`` graph's KV cache after parity (``com.microsoft.PagedAttention``, CUDA only;
:mod:`tfgraph.exporters.ort.paging`; its compatibility statement is that module's docstring and
docs/serving.md).
"""

from __future__ import annotations

import dataclasses

from tfgraph.exporters.ort.target import ORT, lower_norm_with_skip
from tfgraph.exporters.target import SessionSettings
from tfgraph.exporters.targets import register

register(
    dataclasses.replace(
        ORT,
        name="ort-cuda",
        description="ONNX Runtime, CUDA provider: contrib kernels with skip (residual) norms",
        lower_norm=lower_norm_with_skip,
        session=SessionSettings(providers=("cuda", "cpu")),
        precisions=("fp32", "fp16"),
        weight_formats=("int8", "int4"),  # com.microsoft.MatMulNBits
        weight_accuracy_levels=(0,),  # activation quantization is a CPU-kernel mode
        kv_layouts=("paged",),  # PagedAttention: CUDA only, unverified until a GPU is lent
        facts=(
            *ORT.facts,
            "SkipLayerNormalization folds the residual Add (slower on the CPU)",
            "--kv-layout paged: PagedAttention (CUDA kernel only; graph checked, not run here)",
        ),
    )
)
