"""Layering: graph passes, targets, the contract, ``inspect`` and the artifact reader load no
torch; the library never imports the fuzzer's hypothesis; a plain ONNX Runtime session runs
the ``ort`` graph with the kernels tfgraph chose."""

from __future__ import annotations

import subprocess
import sys

import onnx
import onnxruntime as ort
import pytest

import tfgraph

NO_TORCH = """
import sys
import tfgraph.passes, tfgraph.exporters.targets, tfgraph.contract, tfgraph.runtime
import tfgraph.exporters.manifest
import tfgraph.passes.pipeline.fusions, tfgraph.passes.pipeline.run
import onnx_ir as ir
from tfgraph.cli import main
from tfgraph.exporters.compile import count_fusions
from tfgraph.passes import build_pipeline
from tfgraph.exporters.targets import get_target
path = sys.argv[1]
assert main(["inspect", path]) == 0
model = ir.load(path + "/model.onnx")
for p in build_pipeline(get_target("onnx"), name="cleanup"):
    p(model)
count_fusions(model)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "hypothesis"))
assert not loaded, loaded
print("clean")
"""


def test_passes_inspect_and_reader_import_no_torch(gpt_artifact):
    run = subprocess.run(
        [sys.executable, "-c", NO_TORCH, str(gpt_artifact.out_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("clean")


def test_import_passes_leaves_torch_out():
    code = "import sys, tfgraph.passes; assert 'torch' not in sys.modules; print('ok')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_library_does_not_import_hypothesis():
    code = (
        "import sys, tfgraph, tfgraph.exporting, tfgraph.cli, tfgraph.verify.parity\n"
        "tfgraph.cli.build_parser()\n"
        "assert 'hypothesis' not in sys.modules; print('ok')"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


@pytest.mark.parametrize("preset", ["bert-tiny", "gpt-tiny"])
def test_plain_onnxruntime_session_keeps_the_fast_norm_kernels(preset, tmp_path):
    """ORT's SkipLayerNormFusion fuses a residual Add feeding only a LayerNormalization (a
    post-LN block, a pre-LN model's final norm) into SkipLayerNormalization, several times
    slower on the CPU; the ort graph does not let it, in a session with default options."""
    result = tfgraph.export(preset, tmp_path / preset)
    assert result.passed
    # a raw session, not tests/ort_run.py: what is tested is ONNX Runtime's own optimizer as a
    # plain user gets it (ORT_ENABLE_ALL), and the optimized model it writes
    options = ort.SessionOptions()  # what a plain user gets: ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(tmp_path / preset / "model.onnx"), options)
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    ops = [n.op_type for n in optimized.graph.node]
    assert "SkipLayerNormalization" not in ops
    assert ops.count("LayerNormalization") == result.report["fusions"]["norm"]["fused"]
