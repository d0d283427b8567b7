"""``python -m tfgraph parity ARTIFACT``: re-check against the source, bisect a failure.

A layer broken on purpose (one attention's scale doubled in a 2-layer model) is named by its
PyTorch module with the kernel inside it; sound artifacts (fp32, fp16, int4) re-check clean.
"""

import json

import onnx_ir as ir
import pytest

import tfgraph
from tfgraph.cli import main
from tfgraph.passes.provenance import module_name

KERNELS = ("GroupQueryAttention", "MultiHeadAttention", "Attention")


def _break_attention(model_file, module: str) -> str:
    """Set a wrong softmax scale on the attention kernel of ``module``; its node name."""
    model = ir.load(model_file)
    broken = [n for n in model.graph if n.op_type in KERNELS and module_name(n) == module]
    assert len(broken) == 1, [module_name(n) for n in model.graph if n.op_type in KERNELS]
    broken[0].attributes["scale"] = ir.AttrFloat32("scale", 0.9)
    ir.save(model, model_file)
    return broken[0].name


@pytest.mark.parametrize(
    "preset, options, module",
    [
        ("gpt-tiny", {}, "decoder.blocks.1.attn"),
        ("llama-tiny", {"kv_cache": True}, "decoder.blocks.0.attn"),
        # int8 weights whose kernels quantize activations: judged by the activation rule
        ("gpt2-tiny", {"kv_cache": True, "weights": "int8"}, "decoder.blocks.1.attn"),
    ],
)
def test_a_broken_layer_is_named(tmp_path, capsys, preset, options, module):
    out = tmp_path / "a"
    assert tfgraph.export(preset, out, **options).passed
    assert main(["parity", str(out)]) == 0
    capsys.readouterr()
    node = _break_attention(out / "model.onnx", module)
    assert main(["parity", str(out)]) == 1
    printed = capsys.readouterr().out
    assert f"first diverging module: {module} " in printed, printed
    assert node in printed  # the kernel inside it
    result = json.loads((out / "parity.json").read_text())
    found = result["bisect"]["first_divergence"]
    assert found["module"] == module and found["kernels"][0]["node"] == node
    # every module checked before it was within tolerance
    before = result["bisect"]["checked"][:-1]
    assert before and all(row["passed"] for row in before)


@pytest.mark.parametrize("options", [{"precision": "fp16"}, {"weights": "int4"}])
def test_sound_artifacts_recheck_clean(tmp_path, capsys, options):
    out = tmp_path / "a"
    assert tfgraph.export("gpt2-tiny", out, kv_cache=True, **options).passed
    assert main(["parity", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "re-checked preset:gpt2-tiny" in printed and "FAIL" not in printed


def test_a_directory_that_is_not_an_artifact(tmp_path, capsys):
    (tmp_path / "model.onnx").write_bytes(b"")
    assert main(["parity", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "report.json" in err and len(err.strip().splitlines()) == 1
