"""Speculative decoding on exported models: GroupQueryAttention's verify step of k + 1 tokens
over a past gives the logits of k + 1 one-token steps (fp32 and int8 KV), and greedy tokens
through prompt lookup and a draft model equal plain ``generate`` (a shared KV buffer rolled back
by its length; a Mamba's recurrent state restored and re-run)."""

from __future__ import annotations

import numpy as np
import pytest

import tfgraph
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, generate
from tfgraph.runtime.drafters import DraftModel, PromptLookup
from tfgraph.runtime.speculative import SpeculativeStats
from tfgraph.runtime.speculative_cache import TrackedCache
from tfgraph.runtime.speculative_loop import speculative_generate
from tfgraph.sources import load_source

ATOL = 1e-4  # fp32 parity: a step of several tokens against one-token steps


@pytest.fixture(scope="module")
def llama_tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("spec") / "llama-tiny"
    assert tfgraph.export(load_source("llama-tiny"), out, kv_cache=True).passed
    return out


def _vocab(decoder) -> int:
    return int(decoder.session.signature.outputs[0].shape[-1])


def _verify_equals_single_steps(decoder, k: int = 4) -> float:
    """Max |logits| difference between one step of k + 1 tokens over a 9-token past and k + 1
    one-token steps; also after a rollback (the second verify overwrites rejected positions)."""
    ids = np.random.default_rng(0).integers(1, _vocab(decoder), 9 + 2 * (k + 1)).tolist()
    one = TrackedCache(decoder, 64)
    one.feed(ids[:9])
    singles = np.concatenate([one.feed([t]) for t in ids[9 : 10 + k]])
    many = TrackedCache(decoder, 64)
    many.feed(ids[:9])
    many.feed(ids[10 + k :])  # a verify step that is then rejected whole
    many.truncate(9)
    verify = many.feed(ids[9 : 10 + k])
    return float(np.abs(verify - singles).max())


def _greedy_equal(decoder, draft_decoder=None, n: int = 24) -> SpeculativeStats:
    vocab = _vocab(decoder)
    motif = np.random.default_rng(1).integers(1, vocab, 6).tolist()
    prompt = motif * 3 + motif[:2]  # repeats: prompt lookup finds matches
    config = GenerationConfig(max_new_tokens=n)
    plain = generate(decoder, [prompt], config).tokens[0]
    for drafter in (PromptLookup(), DraftModel(draft_decoder or decoder, decoder)):
        stats = SpeculativeStats()
        assert speculative_generate(decoder, prompt, drafter, config, stats=stats) == plain
        assert stats.emitted == n - 1
    return stats


def test_a_verify_step_gives_the_logits_of_one_token_steps(llama_tiny):
    assert _verify_equals_single_steps(CachedDecoder(Session(llama_tiny))) < ATOL


def test_greedy_speculative_tokens_equal_generate(llama_tiny):
    decoder = CachedDecoder(Session(llama_tiny))
    stats = _greedy_equal(decoder)
    assert stats.acceptance == 1.0  # the model drafting for itself
    assert stats.verify_steps < 23


def test_the_cli_and_load_generate_the_same_tokens_speculatively(llama_tiny, capsys):
    from tfgraph.cli import main

    prompt = "5 9 11 5 9 11 5 9"
    outputs = []
    for flags in ([], ["--prompt-lookup"], ["--draft", str(llama_tiny), "--speculative-k", "3"]):
        assert main(["generate", str(llama_tiny), "--input-ids", prompt, *flags]) == 0
        captured = capsys.readouterr()
        outputs.append(captured.out)
        if flags:
            assert "acceptance" in captured.err and "tokens per step" in captured.err
    assert outputs[0] == outputs[1] == outputs[2] and outputs[0].startswith("[0] ")
    model = tfgraph.load(llama_tiny)
    ids = [int(t) for t in prompt.split()]
    plain = model.generate(ids, max_new_tokens=12)
    assert model.generate(ids, max_new_tokens=12, prompt_lookup=2, adaptive_k=True) == plain
    assert model.speculative_stats.verify_steps >= 1
    assert model.generate(ids, max_new_tokens=12, draft=llama_tiny) == plain
    with pytest.raises(tfgraph.TfgraphError, match="one text or token-id prompt"):
        model.generate([ids, ids], prompt_lookup=2)
    flags = ["--prompt-lookup", "--draft", "x"]
    assert main(["generate", str(llama_tiny), "--input-ids", prompt, *flags]) != 0
    assert "not both" in capsys.readouterr().err


# slow: an int8 export of llama-tiny and one of gpt-tiny (~30 s each on a loaded 2-core machine)
@pytest.mark.slow
def test_int8_kv_rolls_back_by_length_and_draft_for_fp32(llama_tiny, tmp_path):
    path = tmp_path / "int8"
    tfgraph.export(load_source("llama-tiny"), path, kv_cache=True, kv_dtype="int8")
    int8 = CachedDecoder(Session(path))
    assert _verify_equals_single_steps(int8) < 1e-3  # the kernel quantizes appends alike
    _greedy_equal(int8)
    # the int8 model drafting for the fp32 one: the same vocabulary, near but not equal logits
    _greedy_equal(CachedDecoder(Session(llama_tiny)), int8)
    gpt = tmp_path / "gpt"
    assert tfgraph.export("gpt-tiny", gpt, kv_cache=True).passed
    _greedy_equal(CachedDecoder(Session(gpt)))


# slow: a tiny Hugging Face Mamba export takes ~50 s on a loaded 2-core machine
@pytest.mark.slow
def test_a_mamba_state_is_restored_on_rejection(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from tfgraph.tools.coverage import tiny_config

    torch.manual_seed(0)
    config = tiny_config("mamba", "causal-lm")
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path / "hf")
    assert tfgraph.export(str(tmp_path / "hf"), tmp_path / "m", kv_cache=True, target="ort").passed
    decoder = CachedDecoder(Session(tmp_path / "m"))
    assert _verify_equals_single_steps(decoder) < ATOL
    _greedy_equal(decoder)
    # drafts that are wrong: every round rejects, restores the state and re-runs the last token
    prompt = np.random.default_rng(2).integers(1, _vocab(decoder), 12).tolist()
    config = GenerationConfig(max_new_tokens=16)
    stats = SpeculativeStats()
    got = speculative_generate(decoder, prompt, WrongDrafts(_vocab(decoder)), config, stats=stats)
    assert got == generate(decoder, [prompt], config).tokens[0]
    assert stats.accepted < stats.proposed  # rejections happened


class WrongDrafts:
    """Proposes the last token + 1, k times: rejected unless the model happens to agree."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def start(self, prompt, capacity) -> None:
        pass

    def propose(self, context, k):
        return [(context[-1] + 1 + i) % self.vocab for i in range(k)], None
