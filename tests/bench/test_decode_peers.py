"""bench/decode_peers.py: the figures it derives from rounds, the vocabulary it gives llama.cpp's
converter, and (slow) a quick run on a two-layer Llama through the real loops."""

from __future__ import annotations

import json

import pytest

from tfgraph.bench import decode_peers


def test_summary_takes_medians_over_rounds_and_ratios_within_rounds():
    plan = {**decode_peers.QUICK, "rounds": 3}
    found = {
        "tfgraph": ("a", None), "builder": ("b", None), "verify": ("a", None),
        "llama.cpp Q4_0": (None, "no llama.cpp build"),
    }  # fmt: skip
    per_round = {
        "tfgraph": [{"ms": 10.0}, {"ms": 30.0}, {"ms": 12.0}],
        "builder": [{"ms": 11.0}, {"ms": 20.0}, {"ms": 12.0}],
        "verify": [{"ms": 10.0, "verify_ms": 13.0, "ratio": 1.3, "by_new_ms": {"1": 10.0}}] * 2
        + [{"ms": 20.0, "verify_ms": 22.0, "ratio": 1.1, "by_new_ms": {"1": 20.0}}],
    }
    result = decode_peers.summary(plan, found, per_round, [1.0, 1.0, 1.0])
    assert result["engines"]["tfgraph"]["ms"] == 12.0
    assert result["engines"]["tfgraph"]["rounds_ms"] == [10.0, 30.0, 12.0]
    # within each round: 10/11, 30/20, 12/12 -> median 1.0 (not 12/12 of the medians by luck)
    assert result["ratios"]["tfgraph / builder"] == 1.0
    assert result["ratios"][f"verify k={decode_peers.K} / one-token step"] == 1.3
    assert "tfgraph / llama.cpp Q4_0" not in result["ratios"]
    assert result["skipped_engines"] == {"llama.cpp Q4_0": "no llama.cpp build"}
    json.dumps(result)  # what --out writes
    table = decode_peers.markdown(result)
    assert "| tfgraph | 12.00 | 10.0, 30.0, 12.0 |" in table
    assert "| tfgraph / builder | 1.000 |" in table
    assert "| verify: a step of 1 new tokens | 10.00 | |" in table
    assert "llama.cpp Q4_0: skipped (no llama.cpp build)" in table


def test_a_second_block_size_is_compared_with_the_builder_at_the_same_one():
    plan = {**decode_peers.QUICK, "rounds": 2}
    found = {name: ("x", None) for name in ("tfgraph", "builder", "tfgraph b128", "builder b128")}
    per_round = {
        "tfgraph": [{"ms": 10.0}, {"ms": 10.0}],
        "builder": [{"ms": 10.0}, {"ms": 10.0}],
        "tfgraph b128": [{"ms": 8.0}, {"ms": 9.0}],
        "builder b128": [{"ms": 8.0}, {"ms": 10.0}],
    }
    ratios = decode_peers.summary(plan, found, per_round, [0.0] * 3)["ratios"]
    assert ratios["tfgraph b128 / builder b128"] == 0.95  # (1.0 + 0.9) / 2 within rounds
    assert ratios["tfgraph b128 / builder"] == 0.85
    assert "tfgraph b128 / llama.cpp Q4_0" not in ratios  # not timed here


def test_gguf_source_has_a_byte_level_bpe_of_the_checkpoint_vocabulary(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"vocab_size": 700, "rope_theta": 5.0}))
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    out = decode_peers.gguf_source(checkpoint, tmp_path / "gguf")
    assert (out / "model.safetensors").resolve() == (checkpoint / "model.safetensors").resolve()
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    assert len(vocab) == 700 and sorted(vocab.values()) == list(range(700))
    assert len(tokenizer["model"]["merges"]) == 700 - 256
    assert tokenizer["pre_tokenizer"]["type"] == "ByteLevel"
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 5.0
    assert len(set(decode_peers._byte_symbols())) == 256


# slow: a tiny Llama exported by tfgraph and the builder, then each timed in a child process
# (~1-2 min on 2 busy cores)
@pytest.mark.slow
def test_quick_run_times_every_engine_it_has(tmp_path):
    result = decode_peers.run(True, tmp_path, llama=None, block=64)
    engines = result["engines"]
    assert {"tfgraph", "verify"} <= set(engines)
    assert all(entry["ms"] > 0 for entry in engines.values())
    assert engines["verify"]["verify_ms"] > 0 and engines["verify"]["ratio"] > 0
    assert set(engines["verify"]["by_new_ms"]) == {"1", "2", "4", "5", "8"}
    assert result["past"] == decode_peers.QUICK["past"]
    if "builder" in engines:
        assert result["ratios"]["tfgraph / builder"] > 0
        assert result["ratios"]["tfgraph b64 / builder b64"] > 0
