"""The static TensorRT compatibility check (runs everywhere): what the parser refuses at a
version, named by node and PyTorch module, with what to do."""

import json

import onnx_ir as ir
import pytest

import tfgraph
from tfgraph.cli import main
from tfgraph.exporters.tensorrt.compat import check_tensorrt


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("trt-compat")
    plans = {
        "ort": ("ort", False),
        "onnx": ("onnx", False),
        "trt-cached": ("tensorrt", True),
        "trt-14": ("tensorrt@10.14", False),
    }
    for name, (target, cached) in plans.items():
        assert tfgraph.export("llama-tiny", root / name, target=target, kv_cache=cached).passed
    return root


def _errors(findings, op):
    return [f for f in findings if f.op == op and f.severity == "error"]


def test_com_microsoft_ops_are_refused_with_their_module(exports):
    model = ir.load(exports / "ort" / "model.onnx")
    found = _errors(check_tensorrt(model, (10, 15)), "com.microsoft.GroupQueryAttention")
    assert [f.module for f in found] == ["decoder.blocks.0.attn", "decoder.blocks.1.attn"]
    assert all("--target tensorrt" in f.fix for f in found)


def test_rms_normalization_is_refused_before_10_15(exports):
    model = ir.load(exports / "onnx" / "model.onnx")
    found = _errors(check_tensorrt(model, (10, 14)), "RMSNormalization")
    assert len(found) == 5 and found[0].module == "decoder.blocks.0.ln_1"
    assert "10.15" in found[0].reason and "tensorrt@10.14" in found[0].fix
    assert not _errors(check_tensorrt(model, (10, 15)), "RMSNormalization")


def test_a_two_output_attention_is_refused_before_11(exports):
    model = ir.load(exports / "onnx" / "model.onnx")
    old = next(n for n in model.graph if n.op_type == "Attention")
    outputs = [ir.Value(name=f"{old.name}_{k}") for k in ("y", "present_key", "present_value")]
    new = ir.Node(
        "",
        "Attention",
        old.inputs,
        attributes=list(old.attributes.values()),
        outputs=outputs,
        name=old.name,
        metadata_props=dict(old.metadata_props),
    )
    model.graph.insert_before(old, new)
    old.outputs[0].replace_all_uses_with(outputs[0])
    model.graph.remove(old, safe=True)
    found = _errors(check_tensorrt(model, (10, 14)), "Attention")
    assert len(found) == 1 and found[0].module == "decoder.blocks.0.attn"
    assert "one output" in found[0].reason
    assert not _errors(check_tensorrt(model, (11, 0)), "Attention")
    assert _errors(check_tensorrt(model, (10, 13)), "Attention")  # not parsed at all yet


def test_the_tensorrt_targets_own_graphs(exports):
    """What tfgraph writes for TensorRT passes the known rules; the static cache's
    TensorScatter is reported as unverified, not as refused."""
    for name in ("trt-cached", "trt-14"):
        findings = json.loads((exports / name / "report.json").read_text())["compatibility"]
        assert not [f for f in findings if f["severity"] == "error"], findings
    cached = json.loads((exports / "trt-cached" / "report.json").read_text())["compatibility"]
    assert {f["op"] for f in cached} >= {"TensorScatter"}
    assert all(f["severity"] == "unverified" for f in cached)


def test_inspect_with_a_target_prints_and_fails_on_errors(exports, capsys):
    assert main(["inspect", str(exports / "onnx"), "--target", "tensorrt@10.14"]) == 1
    printed = capsys.readouterr().out
    assert "RMSNormalization" in printed and "decoder.blocks.0.ln_1" in printed
    assert main(["inspect", str(exports / "trt-14"), "--target", "tensorrt@10.14"]) == 0
    assert "nothing known to stop its parser" in capsys.readouterr().out
