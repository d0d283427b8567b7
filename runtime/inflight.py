"""In-flight (continuous) batching: requests join and leave a running batch at every step.

:class:`SlotBatcher` keeps a fixed pool of cache **slots**: the rows of one preallocated KV
buffer per layer (``kv_layout`` ``shared``, with per-row past lengths: the ``ort`` target's
``past_sequence_lengths`` input, :mod:`tfgraph.passes.row_lengths`). Each slot holds ``capacity``
positions.

- :meth:`~SlotBatcher.admit` prefills a new request alone, straight into its free slot (a
  batch of one over that row of the buffer: nothing is copied), and returns its first token;
- :meth:`~SlotBatcher.step` runs one decoding step for every active slot at once, each row at
  its own past length and position, and returns each request's next token;
- a request that ends (its limit, its EOS, or :meth:`~SlotBatcher.release` on a cancel) frees
  its slot at once; the next :meth:`admit` may take it.

Each request keeps its own decoding settings and random generator, so its tokens are those of
:func:`tfgraph.runtime.generate` on its prompt alone (greedy and seeded sampling), up to the
fp32 noise of a batched step against a batch of one (a near tie of two logits may break the
other way; tests/test_inflight.py measures it). A step's batch spans the slots up to the highest
active one; a free slot below it runs one dummy token at length 0 (it is overwritten by the
next prefill), so no row of the cache ever moves.

The runner must give rows of a cache (:meth:`tfgraph.runtime.runner.Runner.rows`); the
decoder-only graphs of the ``ort`` target do. Encoder-decoders are refused (their cross K/V
per slot is not built yet).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tfgraph.errors import TfgraphError

from .generate import CachedDecoder, GenerationConfig, choose

logger = logging.getLogger(__name__)


def inflight_support(decoder: CachedDecoder) -> str | None:
    """None when ``decoder`` can batch in flight, else why not (one line)."""
    signature = decoder.session.signature
    if decoder.seq2seq:
        return "encoder-decoder artifacts are batched per request group (no per-slot cross K/V)"
    if not signature.row_lengths:
        return (
            "the artifact's cache takes no per-row past lengths (re-export it with --kv-cache "
            "for the ort target)"
        )
    if not hasattr(decoder.session, "rows"):
        return f"the {type(decoder.session).__name__} runner cannot bind rows of a cache"
    return None


@dataclass
class Request:
    """One request in a slot: its prompt, settings and decoding state."""

    prompt: list[int]
    config: GenerationConfig
    seed: int | None = None
    slot: int = -1
    length: int = 0  # positions in its cache row
    tokens: list[int] = field(default_factory=list)  # chosen so far
    finished: bool = False
    rng: np.random.Generator | None = None
    logits: list[np.ndarray] | None = None  # each chosen token's logits, when kept

    @property
    def last(self) -> int:
        return self.tokens[-1]


class SlotBatcher:
    """``slots`` cache rows of ``capacity`` positions each over one cached artifact."""

    def __init__(
        self, decoder: CachedDecoder, slots: int, capacity: int, *, keep_logits: bool = False
    ) -> None:
        why = inflight_support(decoder)
        if why is not None:
            raise TfgraphError(f"in-flight batching is not available: {why}")
        if slots < 1 or capacity < 2:
            raise TfgraphError(f"slots must be >= 1 and capacity >= 2, got {slots}, {capacity}")
        if decoder.max_positions is not None and capacity > decoder.max_positions:
            raise TfgraphError(
                f"a slot of {capacity} positions is more than the {decoder.max_positions} the "
                "model supports (max_positions in manifest.json); lower the capacity"
            )
        self.decoder, self.slots, self.capacity = decoder, slots, capacity
        self.cache = decoder.session.new_cache(slots, capacity)
        self.active: dict[int, Request] = {}
        self.keep_logits = keep_logits

    # -- slots ---------------------------------------------------------------------------
    @property
    def free(self) -> int:
        return self.slots - len(self.active)

    def kv_bytes_per_slot(self) -> int:
        return sum(a[0].nbytes for a in self.cache.host.values())

    def check(self, prompt: Sequence[int], config: GenerationConfig) -> None:
        """Refuse, before a slot is taken, a request that cannot fit one."""
        config.check()
        if not prompt:
            raise TfgraphError("the prompt is empty: give at least one token")
        # the last new token is returned, never fed back
        needed = len(prompt) + config.max_new_tokens - 1
        if needed > self.capacity:
            raise TfgraphError(
                f"a {len(prompt)}-token prompt with {config.max_new_tokens} new tokens needs "
                f"{needed} positions but a slot holds {self.capacity}; shorten the prompt, ask "
                "for fewer tokens, or serve with a larger slot capacity"
            )

    def admit(self, prompt: Sequence[int], config: GenerationConfig, seed=None) -> Request:
        """Prefill ``prompt`` into a free slot; the request with its first token chosen (it
        may be finished already: one token asked for, or EOS)."""
        self.check(prompt, config)
        if not self.free:
            raise TfgraphError(f"all {self.slots} slots are busy; wait for one to free")
        slot = min(set(range(self.slots)) - set(self.active))
        request = Request(list(prompt), config, seed, slot)
        request.rng = np.random.default_rng(seed if seed is not None else config.seed)
        request.logits = [] if self.keep_logits else None
        tokens = np.asarray([request.prompt], np.int64)
        cache = self.decoder.session.rows(self.cache, slot, slot + 1, [0])
        mask = np.ones_like(tokens) if self.decoder.mask_input is not None else None
        logits, _ = self.decoder.step(tokens, cache, mask)
        request.length = len(prompt)
        self.active[slot] = request
        self._choose(request, logits[0, -1])
        return request

    def step(self) -> dict[int, int]:
        """One token for every active request: ``{slot: token}``; finished requests have
        left their slots when this returns."""
        if not self.active:
            return {}
        width = max(self.active) + 1
        lengths = np.zeros(width, np.int64)
        tokens = np.full((width, 1), 0, np.int64)
        for slot, request in self.active.items():
            lengths[slot], tokens[slot, 0] = request.length, request.last
        cache = self.decoder.session.rows(self.cache, 0, width, lengths)
        mask = None
        if self.decoder.mask_input is not None:  # right-padded: a row's own positions
            mask = (np.arange(cache.length + 1)[None, :] <= lengths[:, None]).astype(np.int64)
        logits, _ = self.decoder.step(tokens, cache, mask)
        out = {}
        for slot, request in list(self.active.items()):
            request.length += 1
            out[slot] = self._choose(request, logits[slot, -1])
        return out

    def release(self, slot: int) -> None:
        """Free ``slot`` now (a finished or cancelled request)."""
        request = self.active.pop(slot, None)
        if request is not None:
            request.finished = True

    # -- decoding --------------------------------------------------------------------------
    def _choose(self, request: Request, logits: np.ndarray) -> int:
        token = int(choose(logits[None, :], request.config, [request.rng])[0])
        if request.logits is not None:
            request.logits.append(logits.copy())
        request.tokens.append(token)
        eos = request.config.eos_token_id
        if len(request.tokens) >= request.config.max_new_tokens or (
            eos is not None and token == eos
        ):
            self.release(request.slot)
        return token


def generate_inflight(
    decoder: CachedDecoder,
    prompts: Sequence[Sequence[int]],
    configs: Sequence[GenerationConfig] | GenerationConfig | None = None,
    *,
    arrivals: Sequence[int] | None = None,
    seeds: Sequence[int | None] | None = None,
    slots: int = 4,
    capacity: int | None = None,
    keep_logits: bool = False,
) -> list[Request]:
    """Every prompt decoded through a :class:`SlotBatcher`: request i arrives before step
    ``arrivals[i]`` (default: all at once) and waits for a free slot in arrival order. The
    finished requests, in prompt order: ``tokens`` are what :func:`tfgraph.runtime.generate`
    gives each prompt alone."""
    n = len(prompts)
    if not isinstance(configs, Sequence):
        configs = [configs or GenerationConfig()] * n
    arrivals = list(arrivals) if arrivals is not None else [0] * n
    seeds = list(seeds) if seeds is not None else [None] * n
    if capacity is None:
        capacity = max(len(p) + c.max_new_tokens for p, c in zip(prompts, configs, strict=True))
    batcher = SlotBatcher(decoder, slots, capacity, keep_logits=keep_logits)
    for prompt, config in zip(prompts, configs, strict=True):
        batcher.check(prompt, config)
    order = sorted(range(n), key=lambda i: arrivals[i])
    results: list[Request | None] = [None] * n
    step = 0
    while order or batcher.active:
        while order and arrivals[order[0]] <= step and batcher.free:
            i = order.pop(0)
            results[i] = batcher.admit(prompts[i], configs[i], seeds[i])
        batcher.step()
        step += 1
    return results
