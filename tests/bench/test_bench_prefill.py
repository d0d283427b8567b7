"""The prefill benchmark's result schema, on the smallest plan (gpt-tiny, one length, one run)."""

from __future__ import annotations

import json

import pytest

from tfgraph.bench import prefill

MEASUREMENT = {"seconds", "peak_rss_mib", "run_extra_rss_mib"}
RATIOS = {"eager_over_config_latency", "config_over_unfused_peak_rss"}


# slow: 1.5 min of benchmark runs; the bench smoke test covers the command
@pytest.mark.slow
def test_prefill_quick_schema(tmp_path, monkeypatch):
    plan = prefill.Plan(
        models={"gpt-tiny": prefill.ModelSpec("gpt-tiny")}, seqs=(16,), repeats=lambda seq: 1
    )
    monkeypatch.setattr(prefill, "QUICK_PLAN", plan)
    messages = []
    result = json.loads(
        json.dumps(prefill.run(True, tmp_path, threads=2, progress=messages.append))
    )

    assert result["threads"] == 2
    assert result["seqs"] == [16]
    assert set(result["models"]) == {"gpt-tiny"}
    model = result["models"]["gpt-tiny"]
    assert model["family"] == "decoder"
    assert model["preset"] == "gpt-tiny"
    assert model["layers"] == 2 and model["d_model"] == 64
    assert model["parity_passed"] == {c: True for c in ("unfused", "ort", "onnx", "tensorrt")}
    assert set(model["configs"]) == set(prefill.CONFIGS)
    for config in prefill.CONFIGS:
        measured = model["configs"][config]["16"]
        assert MEASUREMENT <= set(measured), (config, measured)
        assert measured["seconds"] > 0
        assert measured["peak_rss_mib"] > 0
        ratios = model["ratios"][config]["16"]
        assert set(ratios) == RATIOS
        assert all(value > 0 for value in ratios.values())
    assert model["ratios"]["eager"]["16"]["eager_over_config_latency"] == 1.0
    assert model["ratios"]["unfused"]["16"]["config_over_unfused_peak_rss"] == 1.0
    assert "prefill gpt-tiny ort 16" in messages
    for config in prefill.EXPORTS:  # exported once per target into the workdir
        assert (tmp_path / "prefill" / "gpt-tiny" / config / "model.onnx").is_file()


def test_prefill_skips_what_would_not_fit(tmp_path, monkeypatch):
    """A configuration over the memory limit, or whose process fails, is skipped; so are the
    ratios that need it."""
    monkeypatch.setattr(prefill, "MEMORY_LIMIT_GIB", 0.1)
    cfg = prefill._model_config("gpt-tiny", {"max_seq_len": 8192})
    assert "estimated peak" in prefill._skip_reason(cfg, 10**5, 8192, "eager")
    assert "max_seq_len" in prefill._skip_reason(cfg, 10**5, 9000, "ort")
    configs = {c: {"16": {"seconds": 1.0, "peak_rss_mib": 2.0}} for c in prefill.CONFIGS}
    configs["unfused"]["16"] = {"skipped": "estimated peak 20 GiB > limit 18 GiB"}
    ratios = prefill._ratios(configs, [16])
    assert ratios["ort"]["16"] == {"skipped": "no measurement for unfused"}
    spec, inputs = prefill.ModelSpec("gpt-tiny"), prefill._input_spec(("input_ids",), 256, 4)
    failed = prefill._measure("ort", tmp_path / "missing.onnx", spec, inputs, 1, 1)
    assert set(failed) == {"skipped"} and "exit status" in failed["skipped"]
