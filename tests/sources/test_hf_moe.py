"""A Hugging Face mixture-of-experts model from its directory: the library's default experts
(``grouped_mm``) do not trace, so export picks ``batched_mm`` and says so in report.json; the
routers' softmax is not attention; the decoder is cached and generates like eager."""

from __future__ import annotations

import pytest

import tfgraph
from tfgraph.runtime import CachedDecoder, Session
from tfgraph.sources import load_source
from tfgraph.verify.generation_parity import compare_greedy

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    config = transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("hf") / "mixtral"
    transformers.MixtralForCausalLM(config).eval().save_pretrained(path)
    return path


def test_hf_moe_exports_with_a_traceable_experts_implementation(mixtral_dir, tmp_path):
    result = tfgraph.export(str(mixtral_dir), tmp_path / "art", kv_cache=True)
    report = result.report
    assert report["source"]["experts_implementation"] == "batched_mm"
    assert "grouped_mm does not trace" in report["source"]["experts_note"]
    attention = report["fusions"]["attention"]
    assert (attention["fused"], attention["total"], attention["missed"]) == (2, 2, [])
    assert result.passed and report["parity"]["decode"]["passed"]
    source = load_source(str(mixtral_dir))
    decoder = CachedDecoder(Session(tmp_path / "art"))
    assert compare_greedy(source, decoder, [[5, 9, 2, 7], [3, 1]], 8).passed


# slow: 2 min; the traceable-experts MoE export stays in the default tier
@pytest.mark.slow
def test_a_router_over_flattened_tokens_is_cached(tmp_path):
    """JetMoE routes over the tokens flattened into one axis: its (batch·T, experts) scatter
    buffer has no sequence axis to slice, and read at L it broke the cached graph ("Shape
    mismatch attempting to re-use buffer"); it keeps its T-length original, and the cache
    passes prefill and decode parity and generates like eager."""
    config = transformers.JetMoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_key_value_heads=2,
        kv_channels=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    transformers.JetMoeForCausalLM(config).eval().save_pretrained(tmp_path / "hf")
    result = tfgraph.export(str(tmp_path / "hf"), tmp_path / "art", kv_cache=True)
    parity = result.report["parity"]
    assert parity["prefill"]["passed"] and parity["decode"]["passed"]
    attention = result.report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == 2
    decoder = CachedDecoder(Session(tmp_path / "art"))
    source = load_source(str(tmp_path / "hf"))
    assert compare_greedy(source, decoder, [[5, 9, 2, 7], [3, 1]], 8).passed
