"""Compile a traced graph with a pipeline and target, then prove it against eager PyTorch."""

from __future__ import annotations

import onnx_ir as ir

from tfgraph.exporters.compile import count_fusions, run_pipeline
from tfgraph.passes.pipeline.fusions import op_histogram
from tfgraph.verify.parity import check_parity


def compile_and_prove(source, traced: ir.Model, pipeline: str, target: str, tmp_path) -> dict:
    """Run ``pipeline`` on a copy of ``traced``; return fusions, op histogram and parity."""
    model = ir.from_proto(ir.to_proto(traced))
    run_pipeline(model, pipeline, target=target, check_each_pass=True)
    path = tmp_path / f"{pipeline}-{target}.onnx"
    ir.save(model, path)
    return {
        "fusions": count_fusions(model, pipeline),
        "ops": op_histogram(model),
        "parity": check_parity(source, path),
        "model": model,
    }


def assert_export_passed(result, kv_cache: bool, atol: float = 1e-4) -> dict:
    """An export's parity passed; a cached one's prefill and decode too, within ``atol``."""
    parity = result.report["parity"]
    assert result.passed, parity["outputs"]
    if kv_cache:
        assert parity["prefill"]["passed"] and parity["decode"]["passed"]
        assert max(parity["prefill"]["max_abs_err"], parity["decode"]["max_abs_err"]) < atol
    return parity
