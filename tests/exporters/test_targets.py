"""Targets: the registry, a toy target added in one file, pipelines built from targets,
passes' preconditions, unique pass names."""

from __future__ import annotations

import json
import re

import onnx_ir as ir
import pytest
import toy_target

import tfgraph
from tfgraph import TfgraphError
from tfgraph.cli import main
from tfgraph.exporters.compile import run_pipeline
from tfgraph.exporters.ort.share_kv_buffer import ShareKVBufferPass
from tfgraph.exporters.targets import get_target, target_names
from tfgraph.passes import PIPELINES, PipelineOptions, build_pipeline, pass_names
from tfgraph.passes.cache.insert_kv_cache import InsertKVCachePass
from tfgraph.passes.lower.lower_attention import LowerAttentionPass
from tfgraph.passes.pipeline.fusions import op_histogram
from tfgraph.sources import load_source
from tfgraph.sources.trace import trace


def test_builtin_targets_are_registered():
    assert {"ort", "ort-cuda", "onnx", "tensorrt"} <= set(target_names())
    assert get_target("ort").opset == 20 and get_target("onnx").opset == 23
    trt = get_target("tensorrt@10.14")
    assert trt.version == (10, 14) and trt.label == "tensorrt@10.14"
    assert any("builder flags" in f for f in trt.facts)
    assert any("strongly typed" in f for f in get_target("tensorrt@11.0").facts)
    with pytest.raises(TfgraphError, match="unknown .*target 'tpu'"):
        get_target("tpu")
    with pytest.raises(ValueError, match="unknown .*target 'tensorrt@x'"):
        get_target("tensorrt@x", error=ValueError)


def test_targets_cli_lists_them(capsys):
    assert main(["targets", "-v"]) == 0
    out = capsys.readouterr().out
    for name in ("ort", "ort-cuda", "onnx", "tensorrt@10.15", "toy"):
        assert name in out
    assert "RMSNormalization parsed from 10.15" in out
    # what --precision and --weights each target takes, and who verifies bf16 here
    onnx_row = next(line for line in out.splitlines() if line.startswith("onnx "))
    assert "bf16 (onnx-reference)" in onnx_row
    assert "int8,int4" in next(line for line in out.splitlines() if line.startswith("ort "))


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_toy_target_exports_a_preset_with_parity(preset, tmp_path):
    result = tfgraph.export(preset, tmp_path / preset, target="toy")
    assert result.passed, result.report["parity"]["outputs"]
    attention = result.report["fusions"]["attention"]
    assert (attention["fused"], attention["total"]) == (2, 2)
    assert {x["op"] for x in attention["fused_layers"]} == {toy_target.FUSED_AS}
    model = ir.load(tmp_path / preset / "model.onnx")
    hist = op_histogram(model)
    assert hist["Softmax"] == 2 and hist["MatMul"] >= 4
    assert not [op for op in hist if "::" in op or op == "Attention"], hist
    assert result.manifest["target"]["name"] == "toy"
    if preset == "llama-tiny":  # RMSNorm stays standard ops, reported with the toy's reason
        norm = result.report["fusions"]["norm"]
        assert norm["fused"] == 0 and norm["total"] == 5
        assert {m["reason"] for m in norm["missed"]} == {"the toy target has no RMSNorm kernel"}


def test_pipeline_is_built_for_target_and_options():
    plain = pass_names(build_pipeline(get_target("ort")))
    cached = pass_names(build_pipeline(get_target("ort"), PipelineOptions(kv_cache=True)))
    assert "InsertKVCachePass" not in plain and "ShareKVBufferPass" not in plain
    # the recurrent layers' states first, then the KV cache; lowering: attention, recurrences
    classify = cached.index("ClassifyAttentionBiasPass")
    assert cached.index("InsertRecurrentStatePass") == classify + 1
    assert cached.index("InsertKVCachePass") == classify + 2
    assert "InsertRecurrentStatePass" not in plain
    assert cached.index("LowerRecurrentPass") == cached.index("LowerAttentionPass") + 1
    assert cached.index("ShareKVBufferPass") == cached.index("LowerRecurrentPass") + 1
    onnx_cached = pass_names(build_pipeline(get_target("onnx"), PipelineOptions(kv_cache=True)))
    assert "InsertKVCachePass" in onnx_cached and "ShareKVBufferPass" not in onnx_cached
    assert onnx_cached.index("StaticKVCachePass") > onnx_cached.index("LowerAttentionPass")
    trt_cached = pass_names(build_pipeline(get_target("tensorrt"), PipelineOptions(kv_cache=True)))
    assert "StaticKVCachePass" in trt_cached
    assert "StaticKVCachePass" not in pass_names(build_pipeline(get_target("onnx")))
    assert "ExpandAttentionMaskPass" not in pass_names(build_pipeline(get_target("toy")))
    with pytest.raises(ValueError, match="pipeline 'cleanup' fuses none"):
        build_pipeline(get_target("ort"), PipelineOptions(kv_cache=True), name="cleanup")


def test_pass_names_are_unique_per_position():
    names = pass_names(build_pipeline(get_target("ort")))
    assert len(names) == len(set(names))
    assert names.count("RemoveUnusedNodesPass") == 1
    assert "RemoveUnusedNodesPass#2" in names and "RemoveUnusedNodesPass#3" in names


@pytest.fixture(scope="module")
def gpt_traced():
    return load_source("gpt-tiny"), trace(load_source("gpt-tiny"))


def test_dump_after_names_one_position(gpt_traced, tmp_path):
    _, traced = gpt_traced
    model = ir.from_proto(ir.to_proto(traced))
    run_pipeline(model, "default", dump_after="RemoveUnusedNodesPass#2", dump_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["after_RemoveUnusedNodesPass#2.onnx"]
    with pytest.raises(
        TfgraphError, match="has no such pass; choose one of .*TopologicalSortPass#2"
    ):
        run_pipeline(model, "default", dump_after="Nope", dump_dir=tmp_path)


def test_cache_pass_requires_canonical_attention(gpt_traced, monkeypatch):
    """The cache pass after lowering: its requires() names the order, as a one-line error."""
    _, traced = gpt_traced
    model = ir.from_proto(ir.to_proto(traced))
    lowered = [p for p in build_pipeline(get_target("ort")) if not isinstance(p, InsertKVCachePass)]
    monkeypatch.setitem(PIPELINES, "misordered", lambda target: [*lowered, InsertKVCachePass()])
    with pytest.raises(TfgraphError, match="run InsertKVCachePass before LowerAttentionPass"):
        run_pipeline(model, "misordered")


def test_share_pass_requires_lowered_attention(gpt_traced, monkeypatch):
    _, traced = gpt_traced
    model = ir.from_proto(ir.to_proto(traced))
    passes = build_pipeline(get_target("ort"), PipelineOptions(kv_cache=True))
    cut = next(i for i, p in enumerate(passes) if isinstance(p, LowerAttentionPass))
    early = [*passes[:cut], ShareKVBufferPass()]  # before lowering
    monkeypatch.setitem(PIPELINES, "early-share", lambda target: early)
    with pytest.raises(TfgraphError, match="run ShareKVBufferPass after LowerAttentionPass"):
        run_pipeline(model, "early-share")


def test_export_cli_takes_target_names(tmp_path, capsys):
    out = tmp_path / "trt"
    assert main(["export", "llama-tiny", "-o", str(out), "--target", "tensorrt@10.14"]) == 0
    report = (out / "report.json").read_text()
    assert json.loads(report)["target"]["label"] == "tensorrt@10.14"
    assert "TensorRT 10.14 does not parse RMSNormalization" in report
    assert main(["export", "gpt-tiny", "-o", str(tmp_path / "x"), "--target", "tpu"]) == 2
    assert re.search("unknown .*target 'tpu'", capsys.readouterr().err)
    assert not (tmp_path / "x").exists()
    # the old name is no option any more: argparse's usage error, before any export
    assert main(["export", "gpt-tiny", "-o", str(tmp_path / "x"), "--profile", "ort"]) == 2
    assert "unrecognized arguments: --profile ort" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
