"""Engine build and the TensorRT runner: what runs without TensorRT (profiles from the
manifest, the refusals, one-line errors), and the real build where TensorRT and a GPU exist."""

import json

import pytest

import tfgraph
from tfgraph.cli import main
from tfgraph.errors import TfgraphError
from tfgraph.exporters.tensorrt.engines import ProfileOptions, engine_profiles
from tfgraph.runtime import open_runner


@pytest.fixture(scope="module")
def trt_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "llama"
    assert tfgraph.export("llama-tiny", out, target="tensorrt", kv_cache=True).passed
    return out


def test_profiles_come_from_the_manifest_dims(trt_artifact):
    manifest = json.loads((trt_artifact / "manifest.json").read_text())
    options = ProfileOptions(batch=(1, 2, 4), sequence=(1, 16, 64), capacity=128)
    profiles = engine_profiles(manifest["graphs"]["model.onnx"], options)
    ids = profiles["input_ids"]
    assert (ids["min"], ids["opt"], ids["max"]) == ([1, 1], [2, 16], [4, 64])
    past = profiles["past_key_values.0.key"]  # (batch, kv heads, buffer, head size)
    assert (past["min"], past["opt"], past["max"]) == ([1, 2, 1, 8], [2, 2, 128, 8], [4, 2, 128, 8])
    assert profiles["past_sequence_length"]["values"] == ([0], [16], [127])
    with pytest.raises(TfgraphError, match="capacity"):
        engine_profiles(manifest["graphs"]["model.onnx"], ProfileOptions(capacity=8))


def test_engine_refusals_are_one_line(trt_artifact, tmp_path, capsys):
    try:
        import tensorrt  # noqa: F401

        has_trt = True
    except ImportError:
        has_trt = False
    ort = tmp_path / "ort"
    assert tfgraph.export("gpt-tiny", ort).passed
    cases = [([str(ort)], "was exported for target 'ort'"), ([str(tmp_path)], "not a tfgraph")]
    cases.append(([str(trt_artifact), "--batch", "1,2"], "MIN,OPT,MAX"))
    if not has_trt:
        cases.append(([str(trt_artifact)], "TensorRT is not installed here"))
    for argv, needle in cases:
        assert main(["engine", *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err


def test_the_tensorrt_runner_says_what_it_needs(trt_artifact):
    with pytest.raises(TfgraphError, match="TensorRT|CUDA|engine"):
        open_runner(trt_artifact, runner="tensorrt")


def test_engine_build_and_parity_on_a_gpu(trt_artifact):
    """The real path: only where TensorRT and a CUDA GPU exist (tools/gpu_check.sh runs it
    for three presets); skipped here with that reason."""
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (no wheels here)")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    assert main(["engine", str(trt_artifact)]) == 0
    assert (trt_artifact / "model.plan").is_file()
    assert main(["parity", str(trt_artifact)]) == 0


def test_the_second_opinion_against_onnxruntime(trt_artifact, tmp_path, monkeypatch):
    """engine_vs_onnxruntime with ONNX Runtime standing in for the engine: equal runners
    agree (cached: a prefill step; uncached: every output), a skewed one does not."""
    import numpy as np

    import tfgraph.runtime as runtime
    from tfgraph.sources import load_source
    from tfgraph.verify.recheck import engine_vs_onnxruntime

    class Skewed(runtime.Session):
        def run(self, inputs, *, native=False):
            return {n: v * 1.01 for n, v in super().run(inputs).items()}

    plain = tmp_path / "plain"
    assert tfgraph.export("gpt-tiny", plain, target="tensorrt").passed
    for artifact, preset in ((trt_artifact, "llama-tiny"), (plain, "gpt-tiny")):
        stand_in = lambda path, runner=None: runtime.Session(path)  # noqa: E731
        monkeypatch.setattr(runtime, "open_runner", stand_in)
        result = engine_vs_onnxruntime(load_source(preset), artifact / "model.onnx", [(1, 7)])
        assert result["passed"] and result["rows"], result
        assert np.isfinite(result["rows"][0]["max_abs_err"])
    monkeypatch.setattr(runtime, "open_runner", lambda path, runner=None: Skewed(path))
    skewed = engine_vs_onnxruntime(load_source("gpt-tiny"), plain / "model.onnx", [(1, 7)])
    assert not skewed["passed"]


def test_the_eager_reference_of_an_engine_runs_on_its_gpu(trt_artifact, monkeypatch):
    """Parity runs eager where the artifact's runner runs when torch sees that GPU (an engine:
    GPU fp16 against GPU fp16), anything else on the CPU; the result states which."""
    import types

    import torch

    from tfgraph.sources import load_source
    from tfgraph.verify.parity import eager_device
    from tfgraph.verify.recheck import recheck

    engine, cpu = types.SimpleNamespace(device="cuda:0"), types.SimpleNamespace(device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert eager_device(engine) == "cuda:0" and eager_device(cpu) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert eager_device(engine) == "cpu"
    source = load_source("gpt-tiny")
    assert source.on_device("cpu") is source
    # no engine built here: the artifact re-checks its ONNX graph, with eager on the CPU
    result = recheck(trt_artifact, bisect_failures=False)
    assert result["eager_device"] == "cpu" and result["parity"]["passed"]
