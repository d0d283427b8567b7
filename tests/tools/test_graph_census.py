"""The graph census (tfgraph.tools.graph_census): a cached decoder and an encoder exported,
their op histograms, initializers, fusions and parity recorded; errors kept per model."""

import json

import pytest

from tfgraph.tools import graph_census


@pytest.fixture(scope="module")
def censused(tmp_path_factory):
    out = tmp_path_factory.mktemp("census") / "census.json"
    results = graph_census.census(["gpt-tiny", "bert-tiny"], out)
    return out, results


def test_cached_decoder_entry(censused):
    out, results = censused
    assert json.loads(out.read_text()) == results  # what was returned is what was written
    entry = results["gpt-tiny"]
    assert "error" not in entry, entry.get("error")
    assert entry["kv_cache"] is True
    (graph,) = entry["files"].values()
    ops = graph["ops"]
    assert ops["com.microsoft::GroupQueryAttention"] == 2  # one per layer
    assert ops["ai.onnx::LayerNormalization"] == 5  # 2 per layer and the final norm
    assert ops["ai.onnx::Gelu"] == 2
    assert "ai.onnx::ReduceMean" not in ops and "ai.onnx::Softmax" not in ops
    assert graph["nodes"] == sum(ops.values())
    assert graph["initializers"] > 0 and graph["initializer_bytes"] > 256 * 64 * 4
    assert entry["parity_passed"] is True
    assert 0 <= entry["max_abs_err"]["logits"] < 1e-4
    assert entry["prefill_passed"] and entry["decode_passed"]
    assert entry["fusions"]["attention"] == {"fused": 2, "total": 2, "missed": 0}
    assert entry["fusions"]["norm"] == {"fused": 5, "total": 5, "missed": 0}


def test_encoder_entry_without_cache(censused):
    _, results = censused
    entry = results["bert-tiny"]
    assert "error" not in entry, entry.get("error")
    assert entry["kv_cache"] is False and "decode_max_abs_err" not in entry
    (graph,) = entry["files"].values()
    assert sum(n for op, n in graph["ops"].items() if op.endswith("Attention")) == 2
    assert entry["parity_passed"] is True
    # the digest of the initializers' contents tells the two models' weights apart
    assert (
        graph["initializers_sha256"]
        != results["gpt-tiny"]["files"]["model.onnx"]["initializers_sha256"]
    )


def test_unknown_preset_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(KeyError, match=r"unknown preset 'no-such-preset'; known: .*gpt-tiny"):
        graph_census.select(["gpt-tiny", "no-such-preset"])
    out = tmp_path / "census.json"
    assert graph_census.main([str(out), "--only", "no-such-preset"]) == 2
    assert "unknown preset 'no-such-preset'" in capsys.readouterr().err
    assert not out.exists()


def test_selection():
    everything = graph_census.select(None, hf=True)
    assert "gpt2-small" in everything and "hf-gpt2" in everything
    assert not any(n.startswith("hf-") for n in graph_census.select(None))
    cached = graph_census.select(None, kv_cache_only=True, hf=True)
    assert "gpt-tiny" in cached and "t5-tiny" in cached and "hf-llama" in cached
    assert "bert-tiny" not in cached and "hf-vit" not in cached


def test_a_failed_export_is_recorded_and_the_census_goes_on(tmp_path, monkeypatch):
    out = tmp_path / "census.json"
    out.write_text(json.dumps({"earlier": {"kept": True}}))

    def fake(name, work):
        if name == "gpt-tiny":
            raise RuntimeError("boom")
        return {"files": {}}

    monkeypatch.setattr(graph_census, "census_entry", fake)
    seen = []
    results = graph_census.census(
        ["gpt-tiny", "bert-tiny"], out, on_entry=lambda n, e: seen.append(n)
    )
    assert results["gpt-tiny"]["error"] == "RuntimeError: boom"
    assert results["bert-tiny"]["files"] == {}
    assert seen == ["gpt-tiny", "bert-tiny"]
    assert json.loads(out.read_text()) == results and results["earlier"] == {"kept": True}
