"""The peers benchmark in a reduced mode: schema and sanity, no timing assertions."""

import json

import pytest

from tfgraph.bench import peers
from tfgraph.models import PRESETS

ENTRY_KEYS = {
    "available",
    "note",
    "ops",
    "fused_attention",
    "fused_norms",
    "max_abs_err_vs_eager",
    "seconds",
    "peak_rss_mib",
}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(peers, "QUICK", peers.Setup("gpt-tiny", (16,), 1))
        return peers.run(True, tmp_path_factory.mktemp("peers"), threads=1)


def test_schema(result):
    json.dumps(result, allow_nan=False)
    assert result["model"] == "gpt-tiny"
    assert result["threads"] == 1 and result["seqs"] == [16]
    assert set(result["peers"]) == set(peers.PEERS)
    for name, entry in result["peers"].items():
        assert entry["note"], name
        if not entry["available"]:
            continue
        assert ENTRY_KEYS <= set(entry), (name, set(entry))
        assert entry["ops"] and all(n > 0 for n in entry["ops"].values())
        assert entry["max_abs_err_vs_eager"] < 1e-3, name
        assert entry["seconds"]["16"] > 0 and entry["peak_rss_mib"]["16"] > 0, name
        assert not entry["errors"], (name, entry["errors"])


def test_fusions(result):
    layers = PRESETS["gpt-tiny"].n_layers
    tfgraph = result["peers"]["tfgraph"]
    assert tfgraph["available"]
    assert tfgraph["fused_attention"] == layers
    assert tfgraph["fused_norms"] == 2 * layers + 1
    unfused = result["peers"]["unfused"]
    assert unfused["fused_attention"] == 0 and unfused["fused_norms"] == 0
    assert "Softmax" in unfused["ops"] and "Softmax" not in tfgraph["ops"]


def test_ratios(result):
    for name, entry in result["peers"].items():
        if name == "tfgraph" or not entry["available"]:
            assert name not in result["ratios"]
            continue
        assert result["ratios"][name]["16"]["peer_over_tfgraph_latency"] > 0


def test_failing_and_missing_peers_are_recorded(tmp_path, monkeypatch):
    def boom(ctx):
        raise RuntimeError("no fusion for you\nsecond line")

    def missing(ctx):
        raise peers.Unavailable("package not importable")

    monkeypatch.setitem(peers.BUILDERS, "ort_transformers_optimizer", boom)
    monkeypatch.setitem(peers.BUILDERS, "onnxscript_optimize_for_ort", missing)
    ctx = peers.Context(None, PRESETS["gpt-tiny"], tmp_path / "none.onnx", tmp_path)
    entry, built = peers._build_peer("ort_transformers_optimizer", ctx)
    assert built is None
    assert entry == {
        "available": False,
        "note": "failed: RuntimeError: no fusion for you",
        "error": "RuntimeError: no fusion for you",
    }
    entry, built = peers._build_peer("onnxscript_optimize_for_ort", ctx)
    assert built is None and entry == {"available": False, "note": "package not importable"}


def test_count_ops():
    ops = {"com.microsoft::MultiHeadAttention": 2, "Attention": 1, "LayerNormalization": 3}
    assert peers.count_ops(ops, peers.ATTENTION_OPS) == 3
    assert peers.count_ops(ops, peers.NORM_OPS) == 3
