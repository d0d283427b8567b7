"""runtime/session.py's step over a shared KV buffer: the IO binding of a cache is made once and
reused while the steps run over the same buffers, a cache rolled back by its length (a
speculative verification step) reads the same past, another cache gets its own binding, and
each step's logits are a fresh array (no copy, never overwritten by the next step)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tfgraph
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, generate

PROMPT = np.array([[5, 6, 7, 8]])
DRAFT = np.array([[1, 2, 3, 4, 9]])


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    out = tmp_path_factory.mktemp("cached") / "gpt-tiny"
    assert tfgraph.export("gpt-tiny", out, kv_cache=True).passed
    return out


def _prefilled(decoder: CachedDecoder, capacity: int = 12):
    cache = decoder.empty_cache(1, capacity=capacity)
    _, cache = decoder.step(PROMPT, cache)
    return cache


def test_binding_is_reused_and_a_rolled_back_cache_reads_the_same_past(cached):
    session = Session(cached)
    decoder = CachedDecoder(session)
    assert decoder.shared
    cache = _prefilled(decoder)
    binding = session._kept_binding[2]
    five, longer = decoder.step(DRAFT, cache)
    assert session._kept_binding[2] is binding and longer.length == 9
    rolled = dataclasses.replace(longer, length=cache.length)  # the drafts rejected
    one, _ = decoder.step(DRAFT[:, :1], rolled)
    assert session._kept_binding[2] is binding
    np.testing.assert_allclose(one[0, 0], five[0, 0], rtol=1e-4, atol=1e-4)
    assert not np.shares_memory(one, five)
    # a session that binds afresh computes the same logits
    fresh = CachedDecoder(Session(cached))
    reference, _ = fresh.step(DRAFT, _prefilled(fresh))
    np.testing.assert_allclose(five, reference, rtol=1e-5, atol=1e-5)


def test_two_caches_alternating_each_get_their_own_past(cached):
    decoder = CachedDecoder(Session(cached))
    a, b = _prefilled(decoder), decoder.empty_cache(1, capacity=12)
    _, b = decoder.step(np.array([[9, 9]]), b)  # another prompt in another buffer
    from_a, _ = decoder.step(DRAFT[:, :1], a)
    from_b, _ = decoder.step(DRAFT[:, :1], b)
    alone = CachedDecoder(Session(cached))
    want_a, _ = alone.step(DRAFT[:, :1], _prefilled(alone))
    np.testing.assert_allclose(from_a, want_a, rtol=1e-5, atol=1e-5)
    assert np.abs(from_a - from_b).max() > 1e-3  # b's past is not a's


def test_kept_step_logits_are_not_overwritten(cached):
    decoder = CachedDecoder(Session(cached))
    config = GenerationConfig(max_new_tokens=4)
    result = generate(decoder, [[5, 6, 7, 8]], config, keep_logits=True)
    logits = result.step_logits
    assert len(logits) == 4 and all(x.ndim == 2 and x.shape[0] == 1 for x in logits)
    assert [int(x.argmax()) for x in logits] == result.tokens[0]
    assert all(not np.shares_memory(x, y) for x, y in zip(logits, logits[1:], strict=False))


def test_fetched_outputs_are_matched_by_name_on_a_kept_binding(cached):
    """An output whose shape is not known ahead (a hidden state, a recurrent state) is fetched
    from the binding; on a kept binding ONNX Runtime returns the outputs in the order they
    were first bound (the cache's first), not the graph's: each is matched by its name."""
    reference = CachedDecoder(Session(cached))
    want_first, cache = reference.step(PROMPT, reference.empty_cache(1, capacity=12))
    want_next, _ = reference.step(np.array([[9]]), cache)
    session = Session(cached)
    name = next(o.name for o in session._session.get_outputs() if "logits" in o.name)
    session._output_shapes[name] = [None, None, None]  # force the fetched path
    decoder = CachedDecoder(session)
    first, cache = decoder.step(PROMPT, decoder.empty_cache(1, capacity=12))
    again, _ = decoder.step(np.array([[9]]), cache)  # the kept binding
    assert session._kept_binding is not None
    assert first.shape == want_first.shape and again.shape == want_next.shape
    np.testing.assert_allclose(again, want_next, rtol=1e-5, atol=1e-5)
