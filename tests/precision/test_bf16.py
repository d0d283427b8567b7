"""bf16 artifacts of the standard-ONNX target, verified by ONNX's reference evaluator.

ONNX Runtime has no bf16 kernels on the CPU, so the ``onnx`` target's bf16 artifacts name the
``onnx-reference`` runner (``runtime/reference.py``) in their manifest and parity runs there:
every tiny zoo preset, three of them KV-cached, against fp32 eager and eager bf16.
"""

import onnx
import pytest

import tfgraph
from tfgraph.models import PRESETS
from tfgraph.precision.islands import ERROR_FACTOR

TINY = [n for n in PRESETS if n != "gpt2-small"]  # the evaluator is numpy, op by op


def _check_bf16(result, path) -> dict:
    report = result.report
    assert result.passed, report["parity"]["outputs"]
    assert result.manifest["target"]["runner"] == "onnx-reference"
    assert report["parity"]["runner"]["runner"] == "ReferenceRunner"  # stated, not ONNX Runtime
    model = onnx.load(path / "model.onnx")
    floats = [i for i in model.graph.input if i.type.tensor_type.elem_type in (1, 16)]
    assert all(i.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 for i in floats)
    for out in report["parity"]["outputs"]:
        assert out["eager_low_err"] > 0
        assert out["max_abs_err"] <= ERROR_FACTOR * out["eager_low_err"] + 0.1, out
    return report


# slow: the zoo's bf16 sweep (numpy's reference evaluator, op by op); llama-tiny stays
@pytest.mark.parametrize(
    "preset", [p if p == "llama-tiny" else pytest.param(p, marks=pytest.mark.slow) for p in TINY]
)
def test_zoo_bf16_on_the_reference_runner(tmp_path, preset):
    result = tfgraph.export(preset, tmp_path / "a", target="onnx", precision="bf16")
    _check_bf16(result, tmp_path / "a")


# slow: bf16 with the cache, three presets; gpt-tiny stays
@pytest.mark.parametrize(
    "preset",
    [
        "gpt-tiny",
        pytest.param("llama-tiny", marks=pytest.mark.slow),
        pytest.param("t5-tiny", marks=pytest.mark.slow),
    ],
)
def test_zoo_bf16_cached(tmp_path, preset):
    result = tfgraph.export(preset, tmp_path / "a", target="onnx", precision="bf16", kv_cache=True)
    report = _check_bf16(result, tmp_path / "a")
    assert report["parity"]["prefill"]["passed"] and report["parity"]["decode"]["passed"]
    assert report["parity"]["greedy"]["tokens"] > 0


def test_bf16_is_refused_where_nothing_runs_it(tmp_path):
    with pytest.raises(tfgraph.TfgraphError, match="does not take --precision bf16"):
        tfgraph.export("gpt-tiny", tmp_path / "a", target="ort", precision="bf16")
    assert not (tmp_path / "a").exists()
