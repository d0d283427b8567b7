"""Speculative decoding in the in-flight batcher (tfgraph.runtime.inflight_speculative): every
decoding slot's drafts are verified in one (width, k + 1) step at per-row lengths, each row
rolled back to what it keeps; every request's greedy tokens equal ``generate`` on its prompt
alone, whatever the drafter proposes (the target itself: all accepted; noise: all rejected;
prompt lookup: some)."""

import numpy as np
import pytest

import tfgraph
from tfgraph.errors import TfgraphError
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, generate
from tfgraph.runtime.drafters import DraftModel
from tfgraph.runtime.inflight_speculative import SpeculativeBatcher, open_drafter
from tfgraph.sources import load_source

ARRIVALS = [0, 0, 1, 3, 4]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("speculative") / "llama-tiny"
    tfgraph.export(load_source("llama-tiny"), path, kv_cache=True)
    return CachedDecoder(Session(path))


class Noise:
    """A drafter whose drafts are (almost) all wrong: every row is rolled back."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def start(self, prompt, capacity) -> None:
        pass

    def propose(self, context, k):
        return self.rng.integers(1, 50, k).tolist(), None


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    loop = rng.integers(1, 50, 6).tolist()
    every = rng.permutation(256).tolist()  # every token: prompt lookup always finds the last
    return [loop * 3, every, loop * 2 + [7], [3, 4] * 5, [9]]


def _run(batcher, prompts, configs):
    """The requests through ``batcher``, arriving at ARRIVALS; each step's tokens per slot."""
    order, got, step, given = list(range(len(prompts))), [None] * len(prompts), 0, []
    while order or batcher.active:
        while order and ARRIVALS[order[0]] <= step and batcher.free:
            i = order.pop(0)
            got[i] = batcher.admit(prompts[i], configs[i])
        given.append(batcher.advance())
        step += 1
    return got, given


@pytest.mark.parametrize("drafter", ["self", "noise", "prompt-lookup"])
def test_greedy_tokens_equal_plain_decoding(decoder, drafter):
    factories = {
        "self": lambda: DraftModel(decoder),  # the target drafting for itself
        "noise": Noise,
        "prompt-lookup": open_drafter("prompt-lookup", decoder),
    }
    prompts = _prompts()
    configs = [GenerationConfig(max_new_tokens=n) for n in (12, 9, 14, 7, 1)]
    batcher = SpeculativeBatcher(
        decoder, 3, 300, drafter=factories[drafter], k=4, rows=3, keep_logits=True, prefill_chunk=8
    )
    got, given = _run(batcher, prompts, configs)
    for prompt, config, request in zip(prompts, configs, got, strict=True):
        alone = generate(decoder, [prompt], config, keep_logits=True)
        assert request.tokens == alone.tokens[0]
        for mine, theirs in zip(request.logits, alone.step_logits, strict=True):
            np.testing.assert_allclose(mine, theirs[0], atol=1e-4, rtol=0)
    stats = batcher.stats
    most = max(len(t) for step in given for t in step.values())
    if drafter == "self":  # every draft accepted: up to k + 1 tokens a step
        assert stats.acceptance > 0.9 and most == 5
    elif drafter == "noise":
        assert stats.acceptance < 0.2 and stats.proposed > 20
    else:
        assert stats.proposed > 0
    assert not batcher.drafters and not batcher.active


def test_sampled_requests_keep_their_limits_and_differ(decoder):
    config = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=2.0, top_k=20)
    batcher = SpeculativeBatcher(decoder, 2, 40, drafter=lambda: DraftModel(decoder), k=3)
    a = batcher.admit([1, 2, 3, 4], config, seed=1)
    b = batcher.admit([1, 2, 3, 4], config, seed=2)
    while batcher.active:
        batcher.advance()
    assert len(a.tokens) == len(b.tokens) == 10 and a.tokens != b.tokens


def test_refusals(decoder, tmp_path):
    with pytest.raises(TfgraphError, match="prompt-lookup or a draft artifact"):
        open_drafter(tmp_path / "nothing", decoder)
    with pytest.raises(TfgraphError, match="at least 1"):
        SpeculativeBatcher(decoder, 2, 16, drafter=Noise, k=0)
