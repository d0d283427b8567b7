"""Single-stream speculative generation (issue 49): a drafter proposes ``k`` tokens, one step of
the target verifies them, the cache is rolled back past the rejected ones.

Each round, with ``last`` the newest emitted token (not yet in the target's cache):

1. the drafter proposes ``d1..dk`` after prompt + emitted (:mod:`.drafters`);
2. the target runs ``[last, d1..dk]`` in one :meth:`~tfgraph.runtime.generate.CachedDecoder.step`
   (``k + 1`` new tokens over its past; GroupQueryAttention's causal mask within the step
   makes row ``i`` the logits after ``d1..di``, as ``k + 1`` one-token steps would give);
3. :func:`~tfgraph.runtime.speculative.accept_greedy` or
   :func:`~tfgraph.runtime.speculative.accept_sampled` picks the tokens to emit (accepted + one);
4. the target's cache keeps ``last`` and the accepted drafts only
   (:meth:`~tfgraph.runtime.speculative_cache.TrackedCache.truncate`: a smaller length for a
   shared KV buffer, a restored state and a re-run for recurrent layers).

``k`` is clamped so that no round runs past ``max_new_tokens`` (the cache never holds more than
plain decoding's prompt + ``max_new_tokens`` - 1 positions). A round without drafts (prompt lookup
found nothing) is a plain one-token step. Greedy output equals :func:`generate`'s; sampled output
is distributed as the target's (the rejection rule), not seed-for-seed the same.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import numpy as np

from tfgraph.errors import TfgraphError
from tfgraph.runtime.generate import CachedDecoder, GenerationConfig, choose
from tfgraph.runtime.speculative import (
    DraftLength,
    SpeculativeStats,
    accept_greedy,
    accept_sampled,
)
from tfgraph.runtime.speculative_cache import TrackedCache, check_speculative

logger = logging.getLogger(__name__)

__all__ = ["speculative_generate", "speculative_stream"]


def speculative_stream(
    decoder: CachedDecoder,
    prompt: Sequence[int],
    drafter,
    config: GenerationConfig | None = None,
    *,
    length: DraftLength | None = None,
    stats: SpeculativeStats | None = None,
) -> Iterator[list[int]]:
    """Yield the tokens each round emits (the prompt's first token alone, then accepted + one
    per verify step), up to ``config.max_new_tokens`` and the first EOS (included)."""
    config = config or GenerationConfig()
    config.check()
    check_speculative(decoder)
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise TfgraphError("every prompt needs at least one token")
    limit = config.max_new_tokens
    decoder.check_positions(
        len(prompt) + limit - 1, f"a {len(prompt)}-token prompt with {limit} new tokens"
    )
    length = length or DraftLength()
    stats = stats if stats is not None else SpeculativeStats()
    rng = np.random.default_rng(config.seed)
    if hasattr(drafter, "config"):
        drafter.config = config
    capacity = len(prompt) + limit
    target = TrackedCache(decoder, capacity)
    drafter.start(prompt, capacity)
    logits = target.feed(prompt)[-1]
    first = int(choose(logits[None], config, rng)[0])
    emitted, done = [first], first == config.eos_token_id
    yield [first]
    while len(emitted) < limit and not done:
        k = min(length.k, limit - len(emitted) - 1)
        draft, probs = drafter.propose(prompt + emitted, k) if k > 0 else ([], None)
        draft = list(draft[:k])
        probs = None if probs is None else probs[: len(draft)]
        kept = len(target)
        logits = target.feed([emitted[-1], *draft])
        if config.do_sample:
            out = accept_sampled(draft, probs, logits, config, rng)
        else:
            out = accept_greedy(draft, logits)
        target.truncate(kept + len(out))  # last + the accepted drafts
        stats.record(len(draft), len(out))
        if draft:
            length.update(len(draft), len(out) - 1)
        if config.eos_token_id is not None and config.eos_token_id in out:
            out, done = out[: out.index(config.eos_token_id) + 1], True
        out = out[: limit - len(emitted)]
        emitted.extend(out)
        yield out
    logger.info("%s", stats.summary())


def speculative_generate(
    decoder: CachedDecoder,
    prompt: Sequence[int],
    drafter,
    config: GenerationConfig | None = None,
    *,
    length: DraftLength | None = None,
    stats: SpeculativeStats | None = None,
) -> list[int]:
    """The new tokens after ``prompt`` (one request), by :func:`speculative_stream`."""
    tokens: list[int] = []
    for out in speculative_stream(decoder, prompt, drafter, config, length=length, stats=stats):
        tokens.extend(out)
    return tokens
