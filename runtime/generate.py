"""Token generation with a KV-cached artifact (``export --kv-cache``), on any runner.

:class:`CachedDecoder` drives a graph through the runner protocol (:mod:`.runner`) and the
artifact's roles (:mod:`tfgraph.contract`): the new tokens go to the ``token_ids`` input, the
padding mask over past + new tokens to ``attention_mask``, the cache to ``past_key`` /
``past_value`` of each layer, and ``logits`` come back. The runner keeps the cache where it
runs: with ONNX Runtime, the previous step's present ``OrtValue`` objects are bound as the next
step's past, or, for a shared-buffer artifact (``kv_layout`` ``shared``), past and present are
the same preallocated buffer and the kernel appends in place. See docs/kv-cache.md.

Decoding: greedy, or sampling with temperature, top-k, top-p and a seed; stops at
``max_new_tokens`` or when every row has produced ``eos_token_id``. Prompts of different lengths
are left-padded with ``pad_token_id``; with an ``attention_mask`` input the padding is masked,
without one the model sees the pad tokens (as eager PyTorch on the same padded batch does).
An artifact that reads its past lengths off the mask (``--flavour genai``: onnxruntime-genai's
right-padded convention, ``kv_layout.lengths_from``) gets each step's batch compacted first
(:func:`compacted`): a row's real tokens first, the mask 1 on the row's own positions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from tfgraph import contract
from tfgraph.errors import TfgraphError
from tfgraph.runtime.runner import KVCache, Runner

logger = logging.getLogger(__name__)

ENCODER_FILE = contract.ENCODER_FILE  # encoder-decoder artifacts: cross-attention K/V, run once
_CACHE_ROLES = (
    contract.PAST_KEY,
    contract.PAST_VALUE,
    contract.PAST_TOKENS,
    contract.PAST_LENGTH,
    contract.PAST_LENGTHS,
    *contract.STATE_ROLES,
)


@dataclass
class GenerationConfig:
    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int = 0

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise TfgraphError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.do_sample and self.temperature <= 0:
            raise TfgraphError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise TfgraphError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise TfgraphError(f"top_k must be >= 0, got {self.top_k}")


@dataclass
class Generation:
    """``tokens[b]``: the new tokens of row b (up to and including EOS); ``step_logits[t]``:
    the (batch, vocab) logits that chose the t-th new token."""

    tokens: list[list[int]]
    step_logits: list[np.ndarray] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)


class CachedDecoder:
    """One KV-cached artifact on a runner (:class:`tfgraph.runtime.Session` or any other
    implementation of the runner protocol). ``extra`` inputs (an encoder's attention mask,
    the cross-attention K/V :meth:`encode` returns) are fed unchanged at every step."""

    def __init__(self, session: Runner) -> None:
        self.session = session
        signature = session.signature
        token = signature.input(contract.TOKEN_IDS)
        self.layers = signature.cache_layers
        if token is None or not signature.cached:
            names = ", ".join(p.name for p in signature.inputs)
            raise TfgraphError(
                f"'{session.path}' has no KV cache (inputs: {names}); export it with --kv-cache"
            )
        self.token_input = token.name
        mask = signature.input(contract.ATTENTION_MASK)
        self.mask_input = mask.name if mask is not None else None
        self.shared = signature.shared_buffer
        # past lengths read off the mask (the genai flavour): each step's batch is compacted
        self.lengths_from_mask = signature.lengths_from_mask and self.mask_input is not None
        self.extra_inputs = [
            p.name
            for p in signature.inputs
            if p.role not in (contract.TOKEN_IDS, contract.ATTENTION_MASK, *_CACHE_ROLES)
        ]
        self._keys = {p.name: p.key for p in signature.inputs}
        self._slot_masks = {
            p.name for p in signature.inputs if p.role == contract.ENCODER_SLOT_MASK
        }
        # a vision-language decoder merges its image features at the prompt only: later steps
        # get none (an image token generated later is embedded, as in Hugging Face's generate)
        self._prompt_only = {p.name for p in signature.inputs if p.role == contract.IMAGE_FEATURES}
        self._logits = (signature.output(contract.LOGITS) or signature.outputs[0]).key
        self.encoder = None
        self.encoder_inputs: list[str] = []
        if (session.path.parent / ENCODER_FILE).is_file():
            self.encoder = session.sibling(ENCODER_FILE)
            self.encoder_inputs = [p.name for p in self.encoder.signature.inputs]
        self.max_positions = session.max_positions  # None: the artifact states no limit

    def _all_inputs(self) -> list:
        """The step graph's inputs and, for a split encoder-decoder, the encoder's."""
        encoder = self.encoder.signature.inputs if self.encoder is not None else ()
        return [*self.session.signature.inputs, *encoder]

    @property
    def seq2seq(self) -> bool:
        """An encoder-decoder artifact: prompts feed the encoder, the decoder starts afresh.
        Not a vision-language decoder whose encoder is its image's cross K/V (Mllama's: the
        prompts are the decoder's, the encoder reads the vision graph's image features)."""
        inputs = self._all_inputs()
        if any(p.role == contract.IMAGE_FEATURES for p in inputs):
            return False
        return self.encoder is not None or any(p.role == contract.ENCODER_TOKEN_IDS for p in inputs)

    def encoder_feeds(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        """Encoder-decoder generation: the left-padded prompts and their padding mask, by the
        names the encoder (and the step graph) give the encoder's tokens and mask."""
        feeds = {}
        for port in self._all_inputs():
            if port.role == contract.ENCODER_TOKEN_IDS:
                feeds[port.name] = ids
            elif port.role == contract.ENCODER_ATTENTION_MASK:
                feeds[port.name] = mask
        return feeds

    def _cross_length(self, extra: dict | None) -> int:
        """The encoder positions of the cross K/V in ``extra`` (runner values or arrays)."""
        for port in self._all_inputs():
            value = (extra or {}).get(port.name)
            if port.role == contract.CROSS_KEY and value is not None:
                shape = value.shape() if callable(value.shape) else value.shape
                return int(shape[2])
        raise TfgraphError("the step graph needs the encoder's cross-attention keys")

    def check_positions(self, needed: int, what: str) -> None:
        """Refuse, before the runner runs, more positions than the model supports."""
        if self.max_positions is not None and needed > self.max_positions:
            raise TfgraphError(
                f"{what} needs {needed} positions but the model supports {self.max_positions} "
                "(max_positions in manifest.json); shorten the prompt or generate fewer tokens"
            )

    def encode(self, inputs: dict[str, np.ndarray]) -> dict[str, object]:
        """Encoder-decoder artifacts: the cross-attention keys and values, as runner values
        to bind at every step (empty for a decoder-only artifact)."""
        if self.encoder is None:
            return {}
        missing = [n for n in self.encoder_inputs if n not in inputs]
        if missing:
            raise TfgraphError(f"the encoder needs input '{missing[0]}'")
        return self.encoder.run({n: inputs[n] for n in self.encoder_inputs}, native=True)

    def empty_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache for ``batch`` rows; a shared-buffer artifact preallocates room for
        ``capacity`` positions (prompt + new tokens), once."""
        return self.session.new_cache(batch, capacity)

    def step(
        self,
        tokens: np.ndarray,
        cache: KVCache,
        mask: np.ndarray | None = None,
        extra: dict[str, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, KVCache]:
        """Run the new ``tokens`` (batch, T) on ``cache``; returns (logits, next cache).
        ``mask``: the padding mask over past + new positions, when the model takes one;
        ``None`` means nothing is padded. The logits are the step's own array (ONNX Runtime
        writes them into a fresh one: a later step never overwrites them). A cache rolled
        back by a smaller ``length`` (rejected drafts) is stepped on like any other."""
        new = tokens.shape[1]
        self.check_positions(cache.length + new, f"past {cache.length} + {new} new tokens")
        if cache.capacity is not None and cache.length + new > cache.capacity:
            raise TfgraphError(
                f"the KV cache holds {cache.capacity} positions but {cache.length + new} are "
                "needed; allocate it with a larger capacity"
            )
        feeds, order = {}, None
        if self.mask_input is not None:
            if mask is None:  # nothing padded
                mask = np.ones((tokens.shape[0], cache.length + new), np.int64)
            elif np.shape(mask) != (tokens.shape[0], cache.length + new):
                raise TfgraphError(
                    f"'{self.mask_input}' is {tuple(np.shape(mask))}; it spans past + new "
                    f"tokens: ({tokens.shape[0]}, {cache.length + new})"
                )
            mask = np.asarray(mask, np.int64)
            if self.lengths_from_mask:
                tokens, mask, order = compacted(tokens, mask)
            feeds[(contract.ATTENTION_MASK, None)] = mask
        feeds[(contract.TOKEN_IDS, None)] = np.asarray(tokens, np.int64)
        for name in self.extra_inputs:
            if (extra is None or name not in extra) and name in self._slot_masks:
                # the slot mask export added: ones, the model as written (slots feed theirs)
                shape = (tokens.shape[0], self._cross_length(extra))
                feeds[self._keys[name]] = np.ones(shape, np.int64)
                continue
            if extra is None or name not in extra:
                raise TfgraphError(f"the model also needs input '{name}'")
            value = extra[name]
            if name in self._prompt_only:
                value = self._image_features(name, value, cache.length)
            feeds[self._keys[name]] = value
        outputs, cache = self.session.step(feeds, cache, new)
        logits = self.session.to_numpy(outputs[self._logits])
        if order is not None:  # each row's positions back where the caller had them
            logits = np.take_along_axis(logits, np.argsort(order, axis=1)[:, :, None], axis=1)
        return logits, cache

    def _image_features(self, name: str, value, past: int) -> np.ndarray:
        """A vision-language decoder's image features: merged at the prompt only (a later step
        gets (batch, 0, hidden)), in the graph's dtype (an fp16 artifact's)."""
        value = np.asarray(value)[:, :0] if past else np.asarray(value)
        check = getattr(self.session, "check_input", None)  # ONNX Runtime's: casts, checks
        return check(name, value) if check is not None else value


def compacted(tokens: np.ndarray, mask: np.ndarray) -> tuple:
    """A step's batch as a graph that reads past lengths off the mask takes it
    (onnxruntime-genai's convention, :mod:`tfgraph.exporters.flavours.genai_graph`): each
    row's real new tokens first (a left-padded prompt's pads moved after them), and the mask
    ``1`` on the row's first ``sum(mask)`` positions, where its keys lie. (tokens, mask,
    order): ``order[b]`` the new positions' original indices, None when no row moved.

    Pads among the new tokens are a prompt's (an empty past): a row of a later step with
    pads among several new tokens would be read at a wrong past length."""
    order = None
    real = mask[:, mask.shape[1] - tokens.shape[1] :] != 0
    if tokens.shape[1] > 1 and not real.all():
        order = np.argsort(~real, axis=1, kind="stable")  # real ones first, in their order
        tokens = np.take_along_axis(tokens, order, axis=1)
    total = mask.sum(axis=1)
    mask = (np.arange(mask.shape[1])[None, :] < total[:, None]).astype(np.int64)
    return tokens, mask, order


def left_pad(prompts: Sequence[Sequence[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) with every prompt right-aligned; mask 0 on the padding."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise TfgraphError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def probabilities(logits: np.ndarray, config: GenerationConfig) -> np.ndarray:
    """(n, vocab) float64 sampling distributions of (n, vocab) ``logits`` after ``config``'s
    temperature, top-k and top-p: what :func:`choose` draws from (speculative decoding's
    rejection rule reads the same distributions)."""
    scores = np.asarray(logits, np.float64) / config.temperature
    if config.top_k:
        kth = np.sort(scores, axis=-1)[:, -min(config.top_k, scores.shape[-1])][:, None]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    if config.top_p < 1.0:
        order = np.argsort(-probs, axis=-1)
        sorted_probs = np.take_along_axis(probs, order, -1)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        drop_sorted = np.cumsum(sorted_probs, -1) - sorted_probs >= config.top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, -1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(-1, keepdims=True)
    return probs


def choose(logits: np.ndarray, config: GenerationConfig, rng) -> np.ndarray:
    """Next token per row from (batch, vocab) logits; ``rng``: one generator for the rows in
    turn, or a list of one per row."""
    if not config.do_sample:
        return logits.argmax(-1)
    probs = probabilities(logits, config)
    rngs = rng if isinstance(rng, list) else [rng] * len(probs)
    return np.array([g.choice(probs.shape[-1], p=row) for g, row in zip(rngs, probs, strict=True)])


def generate(
    decoder: CachedDecoder,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    *,
    extra: dict[str, np.ndarray] | None = None,
    keep_logits: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Generation:
    """Decode ``config.max_new_tokens`` tokens after each prompt (a list of token ids)."""
    result = Generation([[] for _ in prompts], prompt_lengths=[len(p) for p in prompts])
    for t, step in enumerate(stream(decoder, prompts, config, extra=extra)):
        if keep_logits:
            result.step_logits.append(step.logits)
        for row, token in step.tokens.items():
            result.tokens[row].append(token)
        if progress is not None:
            progress(t + 1)
    return result


@dataclass
class Step:
    """One decoding step: ``tokens`` {row: new token} for the rows still going (a row's EOS
    included), ``logits`` the (batch, vocab) logits that chose them."""

    tokens: dict[int, int]
    logits: np.ndarray


def stream(
    decoder: CachedDecoder,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    *,
    extra: dict[str, np.ndarray] | None = None,
    limits: Sequence[int] | None = None,
    seeds: Sequence[int | None] | None = None,
) -> Iterator[Step]:
    """:func:`generate` one step at a time: yields each step's new tokens as they are chosen
    (servers stream them). Checks the prompts and the cache's positions before the first step.

    For a batch of independent requests (a server's): ``limits`` gives each row its own
    ``max_new_tokens`` (a row stops at its limit, the batch at the largest), ``seeds`` each
    row its own random generator, so that a row samples exactly as it would alone (without
    them, one generator seeded by ``config.seed`` serves the rows in turn, as before)."""
    config = config or GenerationConfig()
    config.check()
    ids, mask = left_pad(prompts, config.pad_token_id)
    if decoder.mask_input is None and len({len(p) for p in prompts}) > 1:
        logger.warning(
            "prompts differ in length and the model has no attention_mask input: "
            "the shorter ones see %d pad token(s)",
            ids.shape[1] - min(len(p) for p in prompts),
        )
    limits = np.asarray(limits if limits is not None else [config.max_new_tokens] * len(prompts))
    if limits.shape != (len(prompts),) or (limits < 1).any():
        raise TfgraphError("limits: one max_new_tokens >= 1 per prompt")
    longest = int(limits.max())
    # the last new token is returned, never fed back: prompt + max_new_tokens - 1 positions
    decoder.check_positions(
        ids.shape[1] + longest - 1, f"a {ids.shape[1]}-token prompt with {longest} new tokens"
    )
    if seeds is not None:
        rng = [np.random.default_rng(seed) for seed in seeds]
    else:
        rng = np.random.default_rng(config.seed)
    return _steps(decoder, ids, mask, config, extra, limits, rng)


def _steps(decoder, ids, mask, config: GenerationConfig, extra, limits, rng) -> Iterator[Step]:
    """The loop: one step per token, the mask a view of one array allocated for the whole
    generation (past + new columns of ones filled in advance), the tokens chosen from the last
    position's logits, which the step returns in a fresh array (kept without a copy)."""
    batch, width = ids.shape
    longest = int(limits.max())
    if decoder.encoder is not None:  # once per prompt, not per step
        extra = {**(extra or {}), **decoder.encode(extra or {})}
    cache = decoder.empty_cache(batch, capacity=width + longest)
    full_mask = np.ones((batch, width + longest - 1), np.int64)
    full_mask[:, :width] = mask
    done = np.zeros(batch, bool)
    tokens = ids
    for t in range(longest):
        step_mask = full_mask[:, : width + t]
        logits, cache = decoder.step(tokens, cache, step_mask, extra)
        # one new token: the (batch, 1, vocab) array is the last position's; a prompt's
        # last position is copied out of its (batch, T, vocab) so the rest can go
        last = logits[:, -1, :] if logits.shape[1] == 1 else logits[:, -1, :].copy()
        chosen = np.where(done, config.pad_token_id, choose(last, config, rng))
        yield Step({int(row): int(chosen[row]) for row in np.flatnonzero(~done)}, last)
        if config.eos_token_id is not None:
            done |= chosen == config.eos_token_id
        done |= limits <= t + 1
        if done.all():
            return
        tokens = chosen[:, None].astype(np.int64)


def seq2seq_prompts(
    decoder: CachedDecoder, prompts: Sequence[Sequence[int]], pad: int, start_token: int
) -> tuple[list[list[int]], dict[str, np.ndarray]]:
    """An encoder-decoder's prompts feed its encoder: (the decoder's prompts — the start token
    per row —, the encoder's feeds)."""
    ids, mask = left_pad(prompts, pad)
    return [[start_token]] * len(prompts), decoder.encoder_feeds(ids, mask)
