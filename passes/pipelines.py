"""Named pass pipelines: plain lists of ``onnx_ir`` passes, built for a target profile.

- ``none``: no rewrite at all; the graph is what the exporter produced.
- ``cleanup``: graph hygiene only (identity elimination, common subexpressions, unused nodes,
  duplicate initializers, topological order).
- ``default``: cleanup, then recognition into canonical ``tfgraph`` ops (norms, GELU,
  attention, whose masks and biases are classified by evaluating them), then lowering
  of those ops to the profile's kernels (``ort``, ``onnx``, ``tensorrt``), the workaround for
  ONNX Runtime's ``Attention`` mask broadcasting, then cleanup.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir
import onnx_ir.passes.common as common

from .classify_attention_bias import ClassifyAttentionBiasPass
from .expand_attention_mask import ExpandAttentionMaskPass
from .fuse_attention import FuseAttentionPass
from .fuse_gelu import FuseGeluPass
from .fuse_norms import FuseNormsPass
from .insert_kv_cache import InsertKVCachePass
from .lower_attention import LowerAttentionPass
from .lower_gelu import LowerGeluPass
from .lower_norms import PROFILES, LowerNormsPass
from .share_kv_buffer import ShareKVBufferPass

# The default-domain opset each profile exports at: ORT's contrib ops need nothing newer than
# 20; the standard ops the others lower to need 23 (RMSNormalization, Attention).
PROFILE_OPSET = {"ort": 20, "onnx": 23, "tensorrt": 23}


def _cleanup(profile: str) -> list[ir.passes.PassBase]:
    return [
        common.IdentityEliminationPass(),
        common.CommonSubexpressionEliminationPass(),
        common.RemoveUnusedNodesPass(),
        common.DeduplicateInitializersPass(),
        common.RemoveUnusedOpsetsPass(),
        common.TopologicalSortPass(),
    ]


def _default(profile: str) -> list[ir.passes.PassBase]:
    return [
        *_cleanup(profile),
        common.ShapeInferencePass(),  # the rules read ranks and head counts from shapes
        FuseNormsPass(),
        FuseGeluPass(),
        FuseAttentionPass(),
        ClassifyAttentionBiasPass(),
        common.RemoveUnusedNodesPass(),  # masks the kernels compute themselves are dead now
        LowerNormsPass(profile),
        LowerGeluPass(profile),
        LowerAttentionPass(profile),
        ExpandAttentionMaskPass(),
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedOpsetsPass(),
        common.TopologicalSortPass(),
    ]


PIPELINES: dict[str, Callable[[str], list[ir.passes.PassBase]]] = {
    "none": lambda profile: [],
    "cleanup": _cleanup,
    "default": _default,
}


def get_pipeline(
    name: str, profile: str = "ort", *, kv_cache: bool = False
) -> list[ir.passes.PassBase]:
    """A fresh list of pass instances for a pipeline and profile; ``KeyError`` if unknown.

    ``kv_cache`` adds :class:`InsertKVCachePass` after the attention biases are classified
    (it works on the canonical ``tfgraph.Attention``, so only pipelines that fuse take it;
    ``ValueError`` otherwise).
    """
    if profile not in PROFILES:
        raise KeyError(profile)
    passes = PIPELINES[name](profile)
    if kv_cache:
        at = [i for i, p in enumerate(passes) if isinstance(p, ClassifyAttentionBiasPass)]
        if not at:
            raise ValueError(f"the KV cache needs fused attention; pipeline '{name}' fuses none")
        passes.insert(at[0] + 1, InsertKVCachePass())
        if profile == "ort":  # GQA appends in place into buffers past and present share
            lower = [i for i, p in enumerate(passes) if isinstance(p, LowerAttentionPass)]
            passes.insert(lower[0] + 1, ShareKVBufferPass())
    return passes
