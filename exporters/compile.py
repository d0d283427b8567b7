"""Compile for a named target: the target-neutral pass runner (:mod:`tfgraph.passes.pipeline`)
with the target resolved here, where the targets live. Passes never resolve a target name
(they sit below the targets); callers that hold a name (the export, the CLI, precision,
tests) come through these three functions."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

from tfgraph.exporters.target import FUSION_KINDS, Target
from tfgraph.exporters.targets import all_fused_ops, all_nonstandard_default_ops, get_target
from tfgraph.passes.pipeline import fusions, run
from tfgraph.passes.pipeline.run import PassRecord


def run_pipeline(
    model: ir.Model,
    name: str,
    *,
    target: Target | str = "ort",
    check_each_pass: bool = False,
    dump_after: str | None = None,
    dump_dir: Path | None = None,
    kv_cache: bool = False,
    max_positions: int | None = None,
    row_lengths: bool = True,
) -> list[PassRecord]:
    """:func:`tfgraph.passes.pipeline.run.run_pipeline` for ``target`` (a name or a target)."""
    return run.run_pipeline(
        model,
        name,
        target=get_target(target),
        check_each_pass=check_each_pass,
        dump_after=dump_after,
        dump_dir=dump_dir,
        kv_cache=kv_cache,
        max_positions=max_positions,
        row_lengths=row_lengths,
    )


def check_model(model: ir.Model, after: str, target: Target | str | None = None) -> None:
    """The checks of :func:`tfgraph.passes.pipeline.run.check_model`, with ``target``'s
    nonstandard default-domain ops (every target's when none is given)."""
    nonstandard = (
        get_target(target).nonstandard_default_ops
        if target is not None
        else all_nonstandard_default_ops()
    )
    run.check_model(model, after, nonstandard)


def count_fusions(
    model: ir.Model, pipeline: str = "default", *, target: Target | str | None = None
) -> dict:
    """:func:`tfgraph.passes.pipeline.fusions.count_fusions` with ``target``'s fused ops; without
    a target, any registered target's (a bare ``.onnx`` file of unknown origin)."""
    fused = (
        {k: get_target(target).fused(k) for k in FUSION_KINDS}
        if target is not None
        else all_fused_ops()
    )
    return fusions.count_fusions(model, pipeline, fused=fused)
