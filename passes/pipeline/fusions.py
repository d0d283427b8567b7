"""Count fusion candidates in a graph, fused or not, per layer, with the reason for each miss.

A *candidate* is a place where a fused kernel could run (which ops are fused kernels is each
target's fact, :attr:`tfgraph.exporters.targets.Target.fused_ops`):

- ``attention``: every fused attention op, plus every ``Softmax`` left in the graph (each one is
  an unfused attention core: scores → softmax → ·V), except a gate's softmax over a projection
  (a mixture-of-experts router: :func:`tfgraph.passes.recognize.attention.fuse.is_gating_softmax`).
  A standard ``Attention`` that the recognition pass could not take over (it carries a miss
  reason) counts as missed, not fused: it was not lowered for the target.
- ``norm``: every normalization op, plus every decomposed norm left in the graph, found by its
  ``ReduceMean`` of a square (``Pow(x, 2)`` or ``Mul(x, x)``: the variance of LayerNorm, the mean
  square of RMSNorm) or its L2 norm (``ReduceL2``, ``LpNormalization``, a sum of squares under a
  ``Sqrt``: ``F.normalize``); one per norm
  (:func:`tfgraph.passes.recognize.fuse_norms.is_norm_candidate`).
- ``gelu``: every GELU op, plus every hand-written GELU left (its ``Erf``, or a ``Tanh`` fed by
  a cube; :func:`tfgraph.passes.recognize.fuse_gelu.unfused_gelu_candidates`).
- ``recurrent``: every linear-attention recurrence and causal convolution traced as a canonical
  op (:mod:`tfgraph.sources.recurrent_kernels`), fused when a kernel runs it, missed when
  lowered to standard ops (a ``Scan``, a ``Conv``).

A miss is never silent: each unfused candidate is listed with its PyTorch module name and a
reason. Passes that try and fail record their reason in the node's metadata under
``tfgraph.miss_reason``; otherwise the reason is that no pass of the pipeline handles the kind.
A candidate left unfused on purpose because no kernel computes it exactly (the seed's
``(σ + ε)`` norm) is listed with ``excluded: true`` and not counted in ``total``.
"""

from __future__ import annotations

from collections import Counter

import onnx_ir as ir

from tfgraph.passes.canonical import RECURRENT_OPS
from tfgraph.passes.provenance import module_name
from tfgraph.passes.recognize.attention.fuse import is_gating_softmax
from tfgraph.passes.recognize.fuse_norms import is_norm_candidate
from tfgraph.passes.rewrite_utils import (
    EXCLUDED_KEY,
    FUSED_AS_KEY,
    LOWERED_FROM_KEY,
    MISS_REASON_KEY,
)


def _unfused_candidates(kind: str, model: ir.Model) -> set[int]:
    if kind == "attention":
        return {
            id(n)
            for n in model.graph
            if n.domain in ("", "ai.onnx")
            and (
                (n.op_type == "Softmax" and not is_gating_softmax(n))
                or (n.op_type == "Attention" and MISS_REASON_KEY in n.metadata_props)
            )
        }
    if kind == "gelu":
        from tfgraph.passes.recognize.fuse_gelu import unfused_gelu_candidates

        return {id(n) for n in unfused_gelu_candidates(model)}
    if kind == "recurrent":  # lowered to standard ops: the Scan / Conv carries the reason
        return {
            id(n)
            for n in model.graph
            if n.metadata_props.get(LOWERED_FROM_KEY) in RECURRENT_OPS
            and MISS_REASON_KEY in n.metadata_props
        }
    return {id(n) for n in model.graph if is_norm_candidate(n)}


def count_fusions(model: ir.Model, pipeline: str = "default", *, fused: dict) -> dict:
    """``{kind: {fused, total, missed: [{module, reason}], fused_modules: [...]}}``.

    What counts as a fused op is ``fused`` (kind → ``{(domain, op_type)}``): the target's
    (``Target.fused``), handed in by :func:`tfgraph.exporters.compile.count_fusions`, which
    resolves a target name (or takes every target's for a file of unknown origin)."""
    fused_by_kind = fused
    result = {}
    for kind, fused_ops in fused_by_kind.items():
        fused, missed = [], []
        unfused = _unfused_candidates(kind, model)
        for node in model.graph:  # fused ops live in the main graph
            key = (node.domain if node.domain != "ai.onnx" else "", node.op_type)
            if key in fused_ops and id(node) not in unfused:
                fused.append({"module": module_name(node), "op": node.op_type})
            elif id(node) in unfused and FUSED_AS_KEY in node.metadata_props:
                fused.append({"module": module_name(node), "op": node.metadata_props[FUSED_AS_KEY]})
            elif id(node) in unfused:
                reason = node.metadata_props.get(
                    MISS_REASON_KEY, f"no {kind} fusion pass in pipeline '{pipeline}'"
                )
                miss = {"module": module_name(node), "reason": reason}
                if node.metadata_props.get(EXCLUDED_KEY) == "true":
                    miss["excluded"] = True
                missed.append(miss)
        result[kind] = {
            "fused": len(fused),
            "total": len(fused) + sum(not m.get("excluded") for m in missed),
            "fused_layers": fused,
            "missed": missed,
        }
    return result


def op_histogram(model: ir.Model) -> Counter:
    """``Counter`` of ``domain::op_type`` (just ``op_type`` for the default domain)."""
    return Counter(
        f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
        for n in model.graph.all_nodes()
    )
