"""In-flight (continuous) batching: requests join and leave a running batch at every step.

:class:`SlotBatcher` keeps a fixed pool of cache **slots**: the rows of one preallocated KV
buffer per layer (``kv_layout`` ``shared``, with per-row past lengths: the ``ort`` target's
``past_sequence_lengths`` input, :mod:`tfgraph.passes.cache.row_lengths`, or a ``--flavour
genai`` artifact's ``attention_mask``, whose row sums it reads them off: the step's mask below
is already in that form). Each slot holds ``capacity`` positions.

- :meth:`~SlotBatcher.admit` prefills a new request alone, straight into its free slot (a
  batch of one over that row of the buffer: nothing is copied), and returns its first token;
- :meth:`~SlotBatcher.step` runs one decoding step for every active slot at once, each row at
  its own past length and position, and returns each request's next token;
- a request that ends (its limit, its EOS, or :meth:`~SlotBatcher.release` on a cancel) frees
  its slot at once; the next :meth:`admit` may take it.

**Chunked prefill** (``prefill_chunk``: prompt tokens per step; None or 0: each prompt whole
at its admit): :meth:`~SlotBatcher.admit` only takes the slot (:attr:`Request.prefilling`);
each :meth:`~SlotBatcher.advance`, after the running requests' decoding step, runs up to that
many prompt tokens in chunks over the waiting rows at their own past lengths, oldest first, so
no decoding step waits for more; a request's first token comes with its last chunk.
**Prefix caching** (``prefix_cache_bytes``; 0: off): a prompt starting with stored K/V blocks
(:mod:`tfgraph.runtime.prefix_cache`) gets them copied into its slot and prefills the rest.

Each request keeps its own decoding settings and random generator, so its tokens are those of
:func:`tfgraph.runtime.generate` on its prompt alone (greedy and seeded sampling), up to the
fp32 noise of a batched step against a batch of one (a near tie of two logits may break the
other way; tests/runtime/test_inflight.py measures it). A step's batch spans the slots up to
the highest decoding one; a free slot below it runs one dummy token at length 0, a prefilling
one at its length (overwritten by the next prefill), so no row of the cache ever moves.

The runner must give rows of a cache (:meth:`tfgraph.runtime.runner.Runner.rows`): ONNX
Runtime's over the ``ort`` target's shared buffer or the ``onnx`` target's static one.

**Encoder-decoders** (a split ``encoder.onnx`` whose step graph masks the encoder's padding):
each slot also holds its request's cross-attention keys and values, ``encoder_capacity``
positions of them, and its row of the encoder mask. :meth:`~SlotBatcher.admit` runs the
encoder on the prompt alone and copies its cross K/V into the slot (zeros and mask 0 after
the prompt); every step binds the slots' cross K/V rows as they lie, so a step's cross
attention reads ``encoder_capacity`` keys per row, the padding masked.

**Vision-language decoders** (a step graph taking the per-prompt inputs of
:data:`tfgraph.contract.PROMPT_ROLES`): :meth:`~SlotBatcher.admit` takes the request's own
(:class:`tfgraph.runtime.vision_language.ImagePrompts`' ``prepare`` of its prompt, one row):
its ``image_features`` are merged at its prefill, alone; every step after gets none,
(batch, 0, hidden), as :func:`tfgraph.runtime.generate` gives them; its other per-prompt
inputs (M-RoPE's ``rope_deltas``, Mllama's ``image_tiles``) stay with the slot and are fed,
one row per slot, at every step. A request without them (a text prompt) gets no features and
a delta of 0; an input with no such default must come with each request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tfgraph import contract
from tfgraph.errors import TfgraphError
from tfgraph.runtime.generate import CachedDecoder, GenerationConfig, choose
from tfgraph.runtime.prefix_cache import DEFAULT_BLOCK, PrefixCache, prefix_cache_support

logger = logging.getLogger(__name__)


_CROSS = (contract.CROSS_KEY, contract.CROSS_VALUE)
# a slot masks its cross K/V's padding with the model's encoder mask or, where the model takes
# none, the one export added (passes/encoder_mask.py)
_ENCODER_MASKS = (contract.ENCODER_ATTENTION_MASK, contract.ENCODER_SLOT_MASK)


_STEP = (contract.TOKEN_IDS, contract.ATTENTION_MASK, contract.PAST_KEY, contract.PAST_VALUE,
         contract.PAST_LENGTH, contract.PAST_LENGTHS)  # fmt: skip


def signature_support(signature: contract.Signature, encoder_file: bool) -> str | None:
    """None when a step graph of this signature can batch in flight (``encoder_file``: the
    artifact has a split ``encoder.onnx``), else why not (one line). Read off the manifest
    alone: ``tfgraph triton`` decides the batching with it."""
    roles = {p.role for p in signature.inputs} - set(_STEP)
    if contract.ENCODER_TOKEN_IDS in roles:
        return "the encoder runs inside the step graph (no encoder.onnx to run per request)"
    if roles & set(_CROSS) or encoder_file:
        if not roles & set(_ENCODER_MASKS):
            return "the step graph takes no encoder mask, so slots cannot pad their cross K/V"
        roles -= {*_CROSS, *_ENCODER_MASKS}
    roles -= set(contract.PROMPT_ROLES)  # a request's own, at its prefill (module doc)
    if roles:
        return f"the step graph also takes {', '.join(sorted(roles))} per request"
    if not signature.row_lengths:
        refused = (signature.kv_layout or {}).get("row_lengths_refused")
        if refused:
            return f"the artifact's cache takes no per-row past lengths: {refused}"
        if (signature.kv_layout or {}).get("kind") == "concat":
            return (
                "the artifact's cache grows per step (--flavour optimum's layout) and takes no "
                "per-row past lengths: export it with the default flavour or --flavour genai"
            )
        return (
            "the artifact's cache takes no per-row past lengths (re-export it with --kv-cache "
            "for the ort or onnx target)"
        )
    return None


def empty_prompt_input(port: contract.Port, rows: int) -> np.ndarray:
    """``rows`` rows of a per-prompt input (:data:`contract.PROMPT_ROLES`) for prompts without
    an image: (rows, 0, hidden) image features, M-RoPE deltas of 0; a one-line error for an
    input that has no such default (each request brings its own)."""
    if port.role == contract.ROPE_DELTAS:
        return np.zeros((rows, 1), np.int64)
    if port.role != contract.IMAGE_FEATURES:
        raise TfgraphError(
            f"the step graph needs each request's '{port.name}' (the processor's, through "
            "ImagePrompts.prepare): give it with every request"
        )
    hidden = (port.shape or [None])[-1]
    if not isinstance(hidden, int):
        raise TfgraphError(f"'{port.name}' states no hidden size; export the model again")
    return np.zeros((rows, 0, hidden), np.float32)


def without_prompt_inputs(decoder: CachedDecoder, rows: int) -> dict[str, np.ndarray]:
    """The step graph's per-prompt inputs for ``rows`` prompts without an image (none for a
    text decoder): what a request without them gets."""
    ports = decoder.session.signature.inputs
    return {p.name: empty_prompt_input(p, rows) for p in ports if p.role in contract.PROMPT_ROLES}


def inflight_support(decoder: CachedDecoder) -> str | None:
    """None when ``decoder`` can batch in flight, else why not (one line)."""
    why = signature_support(decoder.session.signature, decoder.encoder is not None)
    if why is not None:
        return why
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
    rows: dict = field(default_factory=dict)  # its per-prompt inputs fed at every step
    looked_up: bool = False  # in the prefix cache (as its prefill started)

    @property
    def last(self) -> int:
        return self.tokens[-1]

    @property
    def prefilling(self) -> bool:
        """Admitted, its first token still to come (chunked prefill)."""
        return not self.tokens and not self.finished


class SlotBatcher:
    """``slots`` cache rows of ``capacity`` positions each over one cached artifact."""

    def __init__(
        self,
        decoder: CachedDecoder,
        slots: int,
        capacity: int,
        *,
        encoder_capacity: int | None = None,
        keep_logits: bool = False,
        prefill_chunk: int | None = None,
        prefix_cache_bytes: int = 0,
        prefix_block: int = DEFAULT_BLOCK,
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
        self.encoder_capacity = 0
        self.cross: dict[str, np.ndarray] = {}  # encoder-decoders: per-slot cross K/V, mask
        if decoder.seq2seq:
            self._allocate_cross(encoder_capacity or capacity)
        signature = decoder.session.signature
        self.prompt_inputs = {
            p.name: p for p in signature.inputs if p.role in contract.PROMPT_ROLES
        }
        self._options(prefill_chunk, prefix_cache_bytes, prefix_block)

    def _options(self, chunk: int | None, prefix_bytes: int, block: int) -> None:
        """Chunked prefill and prefix caching, each off where it cannot serve right."""
        if (chunk or 0) < 0 or prefix_bytes < 0:
            raise TfgraphError(
                f"prefill_chunk, prefix_cache_bytes must be >= 0: {chunk}, {prefix_bytes}"
            )
        self.prefill_chunk = chunk or None
        if self.prefill_chunk and (self.cross or self.prompt_inputs):
            why = "an encoder-decoder" if self.cross else "image features merge at a whole prompt"
            logger.info("chunked prefill is off: %s", why)
            self.prefill_chunk = None
        self.prefix = None
        if prefix_bytes:
            why = prefix_cache_support(self.cache.host, bool(self.cross), bool(self.prompt_inputs))
            if why is None:
                self.prefix = PrefixCache(prefix_bytes, block)
            else:
                logger.info("prefix caching is off: %s", why)

    def _allocate_cross(self, positions: int) -> None:
        signature = self.decoder.session.signature
        self.encoder_capacity = positions
        for port in signature.inputs:
            if port.role in _CROSS:
                heads, size = port.shape[1], port.shape[3]
                dtype = self.decoder.session.input_dtype(port.name) or np.float32
                self.cross[port.name] = np.zeros((self.slots, heads, positions, size), dtype)
            elif port.role in _ENCODER_MASKS:
                mask = np.zeros((self.slots, positions), np.int64)
                mask[:, 0] = 1  # a free slot's row attends to something (no NaN in its row)
                self.cross[port.name] = mask

    # -- slots ---------------------------------------------------------------------------
    @property
    def free(self) -> int:
        return self.slots - len(self.active)

    def kv_bytes_per_slot(self) -> int:
        cross = sum(a[0].nbytes for a in self.cross.values() if a.ndim == 4)
        return sum(a[0].nbytes for a in self.cache.host.values()) + cross

    def check(self, prompt: Sequence[int], config: GenerationConfig) -> None:
        """Refuse, before a slot is taken, a request that cannot fit one."""
        config.check()
        if not prompt:
            raise TfgraphError("the prompt is empty: give at least one token")
        if self.cross and len(prompt) > self.encoder_capacity:
            raise TfgraphError(
                f"a {len(prompt)}-token prompt is more than the {self.encoder_capacity} encoder "
                "positions a slot holds; shorten it or serve with a larger encoder capacity"
            )
        # the last new token is returned, never fed back (an encoder-decoder's decoder starts
        # from its start token)
        needed = (1 if self.cross else len(prompt)) + config.max_new_tokens - 1
        if needed > self.capacity:
            raise TfgraphError(
                f"a {len(prompt)}-token prompt with {config.max_new_tokens} new tokens needs "
                f"{needed} positions but a slot holds {self.capacity}; shorten the prompt, ask "
                "for fewer tokens, or serve with a larger slot capacity"
            )

    def admit(
        self,
        prompt: Sequence[int],
        config: GenerationConfig,
        seed=None,
        start_token: int = 0,
        extra: dict[str, np.ndarray] | None = None,
    ) -> Request:
        """Prefill ``prompt`` into a free slot; the request with its first token chosen (it
        may be finished already: one token asked for, or EOS), or, with chunked prefill, still
        :attr:`~Request.prefilling` (its first token comes from :meth:`advance`; its slot is
        taken, reused blocks copied in). An encoder-decoder's prompt
        feeds its encoder; its decoder starts from ``start_token``. ``extra``: a
        vision-language prompt's own inputs, one row (module doc)."""
        self.check(prompt, config)
        prompt_extra = self._prompt_extra(extra)
        if not self.free:
            raise TfgraphError(f"all {self.slots} slots are busy; wait for one to free")
        slot = min(set(range(self.slots)) - set(self.active))
        request = Request(list(prompt), config, seed, slot)
        request.rng = np.random.default_rng(seed if seed is not None else config.seed)
        request.logits = [] if self.keep_logits else None
        request.rows = {
            n: v
            for n, v in prompt_extra.items()
            if self.prompt_inputs[n].role != contract.IMAGE_FEATURES
        }
        self.active[slot] = request
        try:
            if self.cross:
                self._encode(slot, np.asarray([request.prompt], np.int64))
                tokens = np.asarray([[start_token]], np.int64)
                cross = self._cross_rows(slot, slot + 1)
                self._choose(request, self._run(request, tokens, cross)[-1])
                return request
            if self.prefill_chunk is None:  # the whole prompt now
                self._lookup(request)
                self._prefill(request, len(request.prompt), prompt_extra or None)
        except Exception:
            self.active.pop(slot, None)
            raise
        return request

    def _run(self, request: Request, tokens: np.ndarray, extra=None) -> np.ndarray:
        """``tokens`` (1, T) over ``request``'s slot row at its length (grown by T); (T, V)."""
        slot = request.slot
        cache = self.decoder.session.rows(self.cache, slot, slot + 1, [request.length])
        n = request.length + tokens.shape[1]
        mask = np.ones((1, n), np.int64) if self.decoder.mask_input is not None else None
        logits, _ = self.decoder.step(tokens, cache, mask, extra)
        request.length = n
        return logits[0]

    def _lookup(self, request: Request) -> None:
        """Prefix caching: the stored blocks its prompt starts with, copied into its slot as
        its prefill starts (not at its admission: a request admitted beside the one that
        stores them finds them once that one's chunks ran)."""
        if self.prefix is not None and not request.looked_up:
            request.length = self.prefix.load(request.prompt, self.cache.host, request.slot)
        request.looked_up = True

    def _prefill(self, request: Request, stop: int, extra=None) -> int | None:
        """The prompt up to ``stop`` into its slot, its full blocks so far stored; at the
        prompt's end, its first token chosen (returned)."""
        logits = self._run(request, np.asarray([request.prompt[request.length : stop]]), extra)[-1]
        if self.prefix is not None:
            self.prefix.store(request.prompt[:stop], self.cache.host, request.slot)
        return self._choose(request, logits) if stop == len(request.prompt) else None

    def step(self) -> dict[int, int]:
        """One token for every active request: ``{slot: token}`` (:meth:`advance`'s last
        token of each); finished requests have left their slots when this returns."""
        return {slot: tokens[-1] for slot, tokens in self.advance().items()}

    def advance(self) -> dict[int, list[int]]:
        """One decoding step for every request past its prefill, then up to
        ``prefill_chunk`` prompt tokens of those still prefilling (oldest first; all of them
        when none decodes: nobody waits); each request's new tokens, ``{slot: [token, ...]}``
        (a request that finished its prefill: its first). Finished requests have left."""
        out = self._decode() if any(r.tokens for r in self.active.values()) else {}
        budget = (self.prefill_chunk or 0) if out else self.slots * self.capacity
        for request in [r for r in self.active.values() if r.prefilling]:
            if budget <= 0:
                break
            self._lookup(request)
            stop = min(len(request.prompt), request.length + budget)
            budget -= stop - request.length
            token = self._prefill(request, stop)
            if token is not None:
                out[request.slot] = [token]
        return out

    def _decode(self, decoding: dict | None = None) -> dict[int, list[int]]:
        decoding = decoding or {slot: r for slot, r in self.active.items() if r.tokens}
        width = max(decoding) + 1
        lengths = np.zeros(width, np.int64)
        tokens = np.full((width, 1), 0, np.int64)
        for slot, request in self.active.items():
            if slot < width:  # a prefilling row's dummy token lands where its next chunk goes
                lengths[slot] = request.length
                tokens[slot, 0] = request.last if request.tokens else 0
        cache = self.decoder.session.rows(self.cache, 0, width, lengths)
        mask = None
        if self.decoder.mask_input is not None:  # right-padded: a row's own positions
            mask = (np.arange(cache.length + 1)[None, :] <= lengths[:, None]).astype(np.int64)
        extra = self._cross_rows(0, width) if self.cross else None
        if self.prompt_inputs:
            extra = {**(extra or {}), **self._step_extra(width)}
        logits, _ = self.decoder.step(tokens, cache, mask, extra)
        out = {}
        for slot, request in decoding.items():
            request.length += 1
            out[slot] = [self._choose(request, logits[slot, -1])]
        return out

    def _prompt_extra(self, extra: dict | None) -> dict[str, np.ndarray]:
        """A request's per-prompt inputs, one row: its own, else none (no image features, a
        delta of 0). Checked before its slot is taken."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(self.prompt_inputs))
        if unknown:
            takes = ", ".join(self.prompt_inputs) or "none"
            raise TfgraphError(
                f"the step graph takes no per-request input {unknown[0]!r} (it takes: {takes})"
            )
        out = {}
        for name, port in self.prompt_inputs.items():
            value = extra.get(name)
            if value is None:
                value = empty_prompt_input(port, 1)
            value = np.asarray(value)
            if value.ndim == 0 or value.shape[0] != 1:
                raise TfgraphError(f"'{name}' of one request is one row, got {value.shape}")
            out[name] = value
        return out

    def _step_extra(self, width: int) -> dict[str, np.ndarray]:
        """A step's per-prompt inputs: no image features; each slot's own row of the others
        (zeros for a free slot)."""
        out = {}
        for name, port in self.prompt_inputs.items():
            if port.role == contract.IMAGE_FEATURES:
                out[name] = empty_prompt_input(port, width)
                continue
            rows = {slot: r.rows[name] for slot, r in self.active.items() if slot < width}
            first = next(iter(rows.values()))
            out[name] = np.zeros((width, *first.shape[1:]), first.dtype)
            for slot, row in rows.items():
                out[name][slot] = row[0]
        return out

    def _encode(self, slot: int, ids: np.ndarray) -> None:
        """The encoder on one prompt; its cross K/V and mask written into ``slot``."""
        decoder = self.decoder
        feeds = decoder.encoder_feeds(ids, np.ones_like(ids))
        values = decoder.encode(feeds)
        n = ids.shape[1]
        for name, array in self.cross.items():
            if array.ndim == 4:
                array[slot] = 0
                array[slot, :, :n] = decoder.session.to_numpy(values[name])[0]
            else:
                array[slot] = 0
                array[slot, :n] = 1

    def _cross_rows(self, start: int, stop: int) -> dict:
        """The step's cross K/V and encoder mask: the slots' rows as they lie (contiguous
        views, bound by the runner as host arrays)."""
        return {name: array[start:stop] for name, array in self.cross.items()}

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
        if len(request.tokens) >= request.config.max_new_tokens or token == eos:  # None: never
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
    encoder_capacity: int | None = None,
    start_token: int = 0,
    keep_logits: bool = False,
    extras: Sequence[dict | None] | None = None,
    **options,
) -> list[Request]:
    """Every prompt decoded through a :class:`SlotBatcher`: request i arrives before step
    ``arrivals[i]`` (default: all at once) and waits for a free slot in arrival order. The
    finished requests, in prompt order: ``tokens`` are what :func:`tfgraph.runtime.generate`
    gives each prompt alone. ``extras[i]``: prompt i's own inputs (a vision-language
    prompt's, one row). ``options``: :class:`SlotBatcher`'s (``prefill_chunk``,
    ``prefix_cache_bytes``, ``prefix_block``)."""
    n = len(prompts)
    if not isinstance(configs, Sequence):
        configs = [configs or GenerationConfig()] * n
    arrivals = list(arrivals) if arrivals is not None else [0] * n
    seeds = list(seeds) if seeds is not None else [None] * n
    extras = list(extras) if extras is not None else [None] * n
    if capacity is None:
        capacity = max(len(p) + c.max_new_tokens for p, c in zip(prompts, configs, strict=True))
    batcher = SlotBatcher(
        decoder, slots, capacity, encoder_capacity=encoder_capacity, keep_logits=keep_logits,
        **options,
    )  # fmt: skip
    for prompt, config in zip(prompts, configs, strict=True):
        batcher.check(prompt, config)
    order = sorted(range(n), key=lambda i: arrivals[i])
    results: list[Request | None] = [None] * n
    step = 0
    while order or batcher.active:
        while order and arrivals[order[0]] <= step and batcher.free:
            i = order.pop(0)
            results[i] = batcher.admit(prompts[i], configs[i], seeds[i], start_token, extras[i])
        batcher.step()
        step += 1
    return results
