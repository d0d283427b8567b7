"""Prefix caching (tfgraph.runtime.prefix_cache) in the in-flight batcher: requests whose
prompts share a prefix reuse its K/V blocks, and every request's tokens and logits are those
of ``generate`` on its prompt alone; blocks are evicted least recently used within the byte
budget; a control corrupts the stored blocks and the logits part, so the comparison can
fail."""

import logging

import numpy as np
import pytest

import tfgraph
from tfgraph import contract
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, SlotBatcher, generate
from tfgraph.runtime.inflight import generate_inflight
from tfgraph.runtime.prefix_cache import PrefixCache, prefix_cache_support
from tfgraph.sources import load_source

ATOL = 1e-4  # the fp32 parity tolerance (a chunk over a past against a whole prompt)
CONFIG = GenerationConfig(max_new_tokens=5)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix") / "llama-tiny"
    tfgraph.export(load_source("llama-tiny"), path, kv_cache=True)
    return CachedDecoder(Session(path))


def _shared_prompts() -> list[list[int]]:
    """Prompts over one 40-token prefix (two full blocks of 16 and a part): with a tail of 1,
    7, 0 and 12 tokens, one unrelated, and the first two blocks alone."""
    rng = np.random.default_rng(3)
    shared = rng.integers(1, 50, 40).tolist()
    tails = [rng.integers(1, 50, n).tolist() for n in (1, 7, 0, 12)]
    return [shared + t for t in tails] + [rng.integers(1, 50, 9).tolist(), shared[:32]]


def _assert_equal_to_alone(decoder, prompts, got) -> None:
    for prompt, request in zip(prompts, got, strict=True):
        alone = generate(decoder, [prompt], CONFIG, keep_logits=True)
        assert request.tokens == alone.tokens[0]
        for mine, theirs in zip(request.logits, alone.step_logits, strict=True):
            np.testing.assert_allclose(mine, theirs[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [None, 7])
def test_shared_prefixes_are_reused_with_the_tokens_of_no_reuse(decoder, chunk):
    prompts = _shared_prompts()
    batcher = SlotBatcher(decoder, 3, 64, keep_logits=True, prefix_cache_bytes=1 << 20)
    batcher.prefill_chunk = chunk
    got = []
    for prompt in prompts:  # one at a time: each finds the blocks the ones before stored
        got.append(batcher.admit(prompt, CONFIG))
        while batcher.active:
            batcher.advance()
    _assert_equal_to_alone(decoder, prompts, got)
    stats = batcher.prefix.stats
    # the first stores two blocks; 47, 40 and 52 tokens find both (52's third block was not
    # stored yet); the two blocks alone reuse the first only (a token is left to prefill)
    assert [r.length - len(r.tokens) + 1 for r in got] == [len(p) for p in prompts]
    assert (stats.lookups, stats.hits, stats.tokens_reused) == (6, 4, 3 * 32 + 16)


def test_a_request_admitted_beside_the_one_storing_a_prefix_finds_it(decoder):
    """Chunked prefill, both admitted at once: the second looks its prefix up as its own
    prefill starts, after the first one's chunks stored the blocks."""
    shared = _shared_prompts()[0][:40]
    prompts = [shared + [5], shared + [6, 7]]
    batcher = SlotBatcher(decoder, 2, 64, keep_logits=True, prefix_cache_bytes=1 << 20)
    batcher.prefill_chunk = 8
    got = [batcher.admit(p, CONFIG) for p in prompts]
    while batcher.active:
        batcher.advance()
    assert batcher.prefix.stats.tokens_reused == 32
    _assert_equal_to_alone(decoder, prompts, got)


def test_results_through_generate_inflight_equal_generate_alone(decoder):
    prompts = _shared_prompts()
    got = generate_inflight(
        decoder, prompts, CONFIG, arrivals=[0, 1, 2, 2, 3, 6], slots=3, keep_logits=True,
        prefix_cache_bytes=1 << 20, prefill_chunk=5,
    )  # fmt: skip
    _assert_equal_to_alone(decoder, prompts, got)


def test_corrupted_blocks_change_the_logits(decoder):
    """The control: stored blocks overwritten with noise are what a hit reads."""
    prompts = _shared_prompts()[:2]
    batcher = SlotBatcher(decoder, 2, 64, keep_logits=True, prefix_cache_bytes=1 << 20)
    batcher.admit(prompts[0], CONFIG)
    rng = np.random.default_rng(0)
    for rows in batcher.prefix.blocks.values():
        for array in rows.values():
            array[...] = rng.normal(0, 3, array.shape)
    hit = batcher.admit(prompts[1], CONFIG)
    alone = generate(decoder, [prompts[1]], CONFIG, keep_logits=True)
    assert batcher.prefix.stats.hits == 1
    assert np.abs(hit.logits[0] - alone.step_logits[0][0]).max() > 100 * ATOL


def test_blocks_are_evicted_least_recently_used_within_the_budget(decoder):
    batcher = SlotBatcher(decoder, 2, 64, keep_logits=True, prefix_cache_bytes=1)
    block_bytes = sum(a[0, :, :16].nbytes for a in batcher.cache.host.values())
    prefix = batcher.prefix = PrefixCache(3 * block_bytes)  # three blocks
    rng = np.random.default_rng(5)
    a, b = (rng.integers(1, 50, 33).tolist() for _ in range(2))  # two full blocks each
    for prompt in (a, b):
        batcher.admit(prompt, CONFIG)
        while batcher.active:
            batcher.advance()
    # a's chain went in first; b's two blocks pushed out a's leaf (its second block) only
    assert prefix.bytes <= prefix.budget and prefix.stats.evictions == 1
    assert list(prefix.blocks) == [prefix.keys(a, 1)[0], *reversed(prefix.keys(b, 2))]
    got = batcher.admit(a + [7], CONFIG)  # its first block only is left
    assert got.length == 16 + 18 and prefix.stats.tokens_reused == 16
    while batcher.active:
        batcher.advance()
    _assert_equal_to_alone(decoder, [a + [7]], [got])
    assert prefix.bytes <= prefix.budget


def test_chained_keys_tell_prefixes_apart():
    cache = PrefixCache(1 << 20, block=2)
    assert cache.keys([1, 2, 3, 4], 2)[0] == cache.keys([1, 2, 9, 9], 2)[0]
    assert cache.keys([1, 2, 3, 4], 2)[1] != cache.keys([5, 6, 3, 4], 2)[1]  # same block
    with pytest.raises(tfgraph.TfgraphError, match="block of >= 1"):
        PrefixCache(10, block=0)


def test_models_it_cannot_serve_right_are_refused_with_the_reason(decoder, caplog):
    host = {("past_key", 0): np.zeros((1, 1, 4, 2))}
    assert prefix_cache_support(host, False, False) is None
    assert "recurrent" in prefix_cache_support(
        {(contract.PAST_RECURRENT_STATE, 0): None, **host}, False, False
    )
    assert "encoder-decoder" in prefix_cache_support(host, True, False)
    assert "image" in prefix_cache_support(host, False, True)
    with caplog.at_level(logging.INFO, logger="tfgraph.runtime.inflight"):
        batcher = SlotBatcher(decoder, 1, 8, prefix_cache_bytes=1 << 20)
        batcher.cross = {"x": None}
        batcher._options(None, 1 << 20, 16)
    assert batcher.prefix is None and "prefix caching is off: an encoder-decoder" in caplog.text


def test_the_servers_defaults_agree():
    """tfgraph serve's and tfgraph triton's flags, the engine and the repository writer."""
    from tfgraph.cli import inflight_flags as flags
    from tfgraph.runtime.serving import openai_engine, repository

    for module in (openai_engine, repository):
        assert module.DEFAULT_PREFILL_CHUNK == flags.DEFAULT_PREFILL_CHUNK > 0
        assert module.DEFAULT_PREFIX_CACHE_MB == flags.DEFAULT_PREFIX_CACHE_MB > 0
