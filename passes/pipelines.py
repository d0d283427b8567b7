"""Named pass pipelines: plain lists of ``onnx_ir`` passes.

- ``none``: no rewrite at all; the graph is what the exporter produced.
- ``cleanup``: graph hygiene only (identity elimination, common subexpressions, unused nodes,
  duplicate initializers, topological order).
- ``default``: what ``export`` runs unless told otherwise. Fusion passes join it as they land.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir
import onnx_ir.passes.common as common


def _cleanup() -> list[ir.passes.PassBase]:
    return [
        common.IdentityEliminationPass(),
        common.CommonSubexpressionEliminationPass(),
        common.RemoveUnusedNodesPass(),
        common.DeduplicateInitializersPass(),
        common.RemoveUnusedOpsetsPass(),
        common.TopologicalSortPass(),
    ]


PIPELINES: dict[str, Callable[[], list[ir.passes.PassBase]]] = {
    "none": list,
    "cleanup": _cleanup,
    "default": _cleanup,
}


def get_pipeline(name: str) -> list[ir.passes.PassBase]:
    """A fresh list of pass instances for a pipeline name; ``KeyError`` if unknown."""
    return PIPELINES[name]()
