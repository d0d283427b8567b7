"""What a target is: one object that says how the canonical graph becomes its graph, and how
that graph runs. Callers never branch on a target's name; they read these fields."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx_ir as ir

    from tfgraph.passes.lower.lower_attention import AttentionCase, Lowered
    from tfgraph.passes.lower.lower_norms import NormCase
    from tfgraph.passes.pipeline.build import PipelineOptions

# The canonical ops count as fused in every target's report (a graph not lowered yet).
CANONICAL_FUSED = {
    "attention": frozenset({("tfgraph", "Attention")}),
    "norm": frozenset({("tfgraph", "LayerNorm"), ("tfgraph", "RMSNorm")}),
    "gelu": frozenset({("tfgraph", "Gelu")}),
    "recurrent": frozenset({("tfgraph", "LinearAttention"), ("tfgraph", "CausalConv")}),
}
FUSION_KINDS = tuple(CANONICAL_FUSED)
STANDARD_FUSED = {  # standard ONNX ops that are fused kernels wherever they run
    "attention": frozenset({("", "Attention")}),
    "norm": frozenset({("", "LayerNormalization"), ("", "RMSNormalization")}),
    "gelu": frozenset({("", "Gelu")}),
    "recurrent": frozenset(),
}
# standard ONNX has no linear-attention or stateful-convolution op
STANDARD_RECURRENT = (
    "standard ONNX has no recurrent kernel: a Scan over the tokens (Conv for the convolution)"
)


def standard_recurrent(tape, node):
    """The default lowering of the canonical recurrent ops: standard ONNX, reported."""
    from tfgraph.passes.lower.lower_recurrent import standard_ops

    return standard_ops(tape, node, STANDARD_RECURRENT)


@dataclass(frozen=True)
class SessionSettings:
    """How the target's runner opens a graph: execution providers in order of preference and
    ONNX Runtime graph transformers to switch off."""

    providers: tuple[str, ...] = ("cpu",)
    disabled_optimizers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Target:
    """A backend: see docs/architecture.md ("Adding a target").

    - ``opset``: the default-domain opset the graph is traced and exported at.
    - ``lower_attention(case) -> Lowered``, ``lower_norm(case) -> Lowered``,
      ``lower_gelu(op, x, spec, opset) -> value``: how each canonical op lowers. The neutral
      passes of :mod:`tfgraph.passes.lower` hand the target a case with the standard builders
      (:mod:`~tfgraph.passes.lower.attention_builder`, ``NormCase`` of
      :mod:`~tfgraph.passes.lower.lower_norms`, ``standard_gelu`` of
      :mod:`~tfgraph.passes.lower.lower_gelu`); a target's own kernels are built in its folder
      (``ort``: :mod:`tfgraph.exporters.ort.attention_gqa`, ``attention_mha``, ``norms``,
      ``gelu``), so that no pass names a backend's op.
    - ``lower_recurrent(tape, node) -> LoweredRecurrence``: how ``tfgraph.LinearAttention``
      and ``tfgraph.CausalConv`` lower (:mod:`tfgraph.passes.lower.lower_recurrent`); standard
      ops unless the target has kernels (``ort``: :mod:`tfgraph.exporters.ort.recurrent`).
    - ``extra_passes(options)``: passes that run after lowering (workarounds, the shared KV
      buffer), with the pipeline's options.
    - ``fused_ops``: per fusion kind (``attention``, ``norm``, ``gelu``), the ``(domain, op)``
      pairs its report counts as fused kernels.
    - ``nonstandard_default_ops``: ops it emits in the default domain that ONNX does not define
      (the checker is shown them as a custom domain).
    - ``session``, ``runner``: how its graphs run (:mod:`tfgraph.runtime` picks the runner).
    - ``precisions``: the ``--precision`` values it accepts.
    - ``weight_formats``: the ``--weights`` formats it runs (``int8``, ``int4``: MatMulNBits).
    - ``weight_accuracy_levels``: MatMulNBits ``accuracy_level`` values it runs, the default
      first: 4 quantizes activations to int8 per block inside the kernel (the CPU provider's
      fast path), 0 computes with fp32 activations.
    - ``precision_runners``: a precision whose artifacts another runner verifies here (bf16:
      ``onnx-reference``, since ONNX Runtime's CPU provider has no bf16 kernels).
    - ``compatibility(model) -> list[dict]``: a static check of a finished graph against the
      backend (TensorRT's parser), findings with node, module, severity, reason and fix.
    - ``facts``: what the target's choices rest on, for ``python -m tfgraph targets``.
    """

    name: str
    description: str
    opset: int
    lower_attention: Callable[[AttentionCase], Lowered]
    lower_norm: Callable[[NormCase], Lowered]
    lower_gelu: Callable[..., ir.Value]
    fused_ops: Mapping[str, frozenset] = field(default_factory=dict)
    extra_passes: Callable[[PipelineOptions], list] = lambda options: []
    lower_recurrent: Callable = standard_recurrent
    nonstandard_default_ops: frozenset = frozenset()
    session: SessionSettings = SessionSettings()
    runner: str = "onnxruntime"
    precisions: tuple[str, ...] = ("fp32",)
    weight_formats: tuple[str, ...] = ()
    weight_accuracy_levels: tuple[int, ...] = (0,)
    precision_runners: Mapping[str, str] = field(default_factory=dict)
    version: tuple[int, ...] | None = None
    compatibility: Callable[[ir.Model], list] = lambda model: []
    # cached graphs take per-row past lengths (rows of a batch at different lengths in one
    # buffer: in-flight batching); passes/row_lengths.py
    row_lengths: bool = False
    # KV cache dtypes besides the graph's float (``--kv-dtype``): tfgraph/precision/kv_cache.py
    kv_dtypes: tuple[str, ...] = ()
    kv_scales: tuple[str, ...] = ("per-tensor",)  # the int8 cache's scale granularities
    # KV layouts besides the default (``--kv-layout``): paged (tfgraph/compile/paging.py)
    kv_layouts: tuple[str, ...] = ()
    facts: tuple[str, ...] = ()

    def fused(self, kind: str) -> frozenset:
        """Every ``(domain, op)`` counted as a fused ``kind`` in this target's graphs."""
        return CANONICAL_FUSED[kind] | self.fused_ops.get(kind, frozenset())

    def runner_for(self, precision: str) -> str:
        """The runner that runs (and verifies) this target's artifacts in ``precision``."""
        return self.precision_runners.get(precision, self.runner)

    @property
    def label(self) -> str:
        if self.version is None:
            return self.name
        return f"{self.name}@{'.'.join(map(str, self.version))}"


def fused_ops(ms: Mapping[str, set] | None = None) -> dict[str, frozenset]:
    """The standard fused ops plus a target's own (``{kind: {(domain, op)}}``)."""
    ms = ms or {}
    return {k: STANDARD_FUSED[k] | frozenset(ms.get(k, ())) for k in FUSION_KINDS}
