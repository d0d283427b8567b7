"""Pass pipelines, built for a target: plain lists of ``onnx_ir`` passes.

- ``none``: no rewrite at all; the graph is what the exporter produced.
- ``cleanup``: graph hygiene only (identity elimination, common subexpressions, unused nodes,
  duplicate initializers, topological order).
- ``default``: cleanup; recognition into canonical ``tfgraph`` ops (norms, GELU, attention,
  whose masks and biases are classified by evaluating them); the KV cache when asked
  (``PipelineOptions.kv_cache``); relative-key tables contracted before their gather;
  lowering of the canonical ops as the target says; the target's own passes
  (``Target.extra_passes``); cleanup.

:func:`build_pipeline` composes them; nothing is spliced in afterwards. Passes that depend on
others say so in ``requires()`` (e.g. :class:`~.insert_kv_cache.InsertKVCachePass` needs
canonical attention, :class:`~.share_kv_buffer.ShareKVBufferPass` lowered attention).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir
import onnx_ir.passes.common as common

from tfgraph.passes.cache.insert_kv_cache import InsertKVCachePass
from tfgraph.passes.cache.insert_recurrent_state import InsertRecurrentStatePass
from tfgraph.passes.lower.lower_attention import LowerAttentionPass
from tfgraph.passes.lower.lower_gelu import LowerGeluPass
from tfgraph.passes.lower.lower_norms import LowerNormsPass
from tfgraph.passes.lower.lower_recurrent import LowerRecurrentPass
from tfgraph.passes.recognize.attention.classify_bias import ClassifyAttentionBiasPass
from tfgraph.passes.recognize.attention.fuse import FuseAttentionPass
from tfgraph.passes.recognize.attention.gather_after_contraction import GatherAfterContractionPass
from tfgraph.passes.recognize.fuse_gelu import FuseGeluPass
from tfgraph.passes.recognize.fuse_norms import FuseNormsPass
from tfgraph.passes.target_arg import require_target


@dataclass(frozen=True)
class PipelineOptions:
    """What the user asked for besides the target: ``kv_cache`` adds past/present K/V;
    ``max_positions`` (the source's, when known) sizes tables such as RoPE's cos/sin caches."""

    kv_cache: bool = False
    max_positions: int | None = None
    # per-row past lengths where the target takes them (in-flight batching); False: the
    # machinery is sliced to the new rows only (one request at a time or a static batch)
    row_lengths: bool = True
    # "shared": past and present share one buffer per layer where the target can (explicit
    # past lengths); "concat": a growing past, present = past + new (Optimum's convention)
    kv_layout: str = "shared"


def _target(target):
    return require_target(target)


def _cleanup(target) -> list[ir.passes.PassBase]:
    return [
        common.IdentityEliminationPass(),
        common.CommonSubexpressionEliminationPass(),
        common.RemoveUnusedNodesPass(),
        common.DeduplicateInitializersPass(),
        common.RemoveUnusedOpsetsPass(),
        common.TopologicalSortPass(),
    ]


def _default(target, options: PipelineOptions = PipelineOptions()) -> list[ir.passes.PassBase]:
    target = _target(target)
    return [
        *_cleanup(target),
        common.ShapeInferencePass(),  # the rules read ranks and head counts from shapes
        FuseNormsPass(),
        FuseGeluPass(),
        FuseAttentionPass(),
        ClassifyAttentionBiasPass(),
        *([InsertRecurrentStatePass()] if options.kv_cache else []),
        *(
            [InsertKVCachePass(row_lengths=target.row_lengths and options.row_lengths)]
            if options.kv_cache
            else []
        ),
        common.RemoveUnusedNodesPass(),  # masks the kernels compute themselves are dead now
        GatherAfterContractionPass(),  # relative-key tables: contract, then gather
        common.RemoveUnusedNodesPass(),
        LowerNormsPass(target),
        LowerGeluPass(target),
        LowerAttentionPass(target),
        LowerRecurrentPass(target),
        *target.extra_passes(options),
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedOpsetsPass(),
        common.TopologicalSortPass(),
    ]


# name → the pipeline's passes for a target (a Target or its name)
PIPELINES: dict[str, Callable[..., list[ir.passes.PassBase]]] = {
    "none": lambda target: [],
    "cleanup": _cleanup,
    "default": _default,
}


def build_pipeline(
    target, options: PipelineOptions | None = None, *, name: str = "default"
) -> list[ir.passes.PassBase]:
    """A fresh list of pass instances for ``target`` (a :class:`tfgraph.exporters.target.Target`:
    ``tfgraph.exporters.targets.get_target(name)``); ``KeyError`` for an unknown pipeline,
    ``ValueError`` for options the pipeline cannot take (only ``default`` fuses attention a
    KV cache can attach to)."""
    options = options or PipelineOptions()
    if name not in PIPELINES:
        raise KeyError(name)
    target = _target(target)
    if name == "default":
        return _default(target, options)
    if options.kv_cache:
        raise ValueError(f"the KV cache needs fused attention; pipeline '{name}' fuses none")
    return PIPELINES[name](target)


def pass_names(passes: list[ir.passes.PassBase]) -> list[str]:
    """One unique name per position: the class name, then ``Name#2``, ``Name#3`` … for a class
    that runs again (``--dump-after`` and ``report.json`` use these)."""
    seen: dict[str, int] = {}
    names = []
    for p in passes:
        base = type(p).__name__
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return names
