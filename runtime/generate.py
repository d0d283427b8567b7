"""Token generation with a KV-cached artifact (``export --kv-cache``) on ONNX Runtime.

The cached graph takes the new tokens, ``past_key_values.{i}.key/.value`` (batch, kv_heads,
past, head_dim) and, when the model has one, an ``attention_mask`` over past + new tokens; it
returns ``logits`` and ``present.{i}.key/.value``. A step binds the previous step's present
``OrtValue`` objects as the next step's past through ONNX Runtime's IO binding: the cache never
travels through Python or numpy. Artifacts of the ``ort`` profile take preallocated buffers
(``past_sequence_length`` input, :mod:`tfgraph.passes.share_kv_buffer`): past and present are
bound to the same buffer and the kernel appends in place, so a step copies nothing; other
artifacts get a fresh present (past + new) per step. See docs/kv-cache.md.

Decoding: greedy, or sampling with temperature, top-k, top-p and a seed; stops at
``max_new_tokens`` or when every row has produced ``eos_token_id``. Prompts of different lengths
are left-padded with ``pad_token_id``; with an ``attention_mask`` input the padding is masked,
without one the model sees the pad tokens (as eager PyTorch on the same padded batch does).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tfgraph.errors import TfgraphError

from .session import Session

logger = logging.getLogger(__name__)

PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)$")
TOKEN_INPUTS = ("decoder_input_ids", "input_ids")
PAST_LENGTH = "past_sequence_length"  # shared-buffer artifacts
ENCODER_FILE = "encoder.onnx"  # encoder-decoder artifacts: cross-attention K/V, run once


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


@dataclass
class KVCache:
    """Per-layer past keys/values as ``OrtValue`` objects, holding ``length`` positions; for a
    shared-buffer artifact each buffer has room for ``capacity`` positions."""

    values: dict[str, object]
    length: int = 0
    capacity: int | None = None


class CachedDecoder:
    """One KV-cached artifact, stepped with IO binding. ``extra`` inputs (an encoder's
    ``attention_mask``, ``input_ids`` of an encoder-decoder graph) are fed unchanged."""

    def __init__(self, session: Session) -> None:
        self.session = session
        ort_session = session.ort_session
        inputs = {i.name: i for i in ort_session.get_inputs()}
        self.token_input = next((n for n in TOKEN_INPUTS if n in inputs), None)
        layers: dict[int, dict[str, object]] = {}
        for name, meta in inputs.items():
            match = PAST.match(name)
            if match:
                layers.setdefault(int(match.group(1)), {})[match.group(2)] = meta
        if self.token_input is None or not layers:
            raise TfgraphError(
                f"'{session.path}' has no KV cache (inputs: {', '.join(inputs)}); export it "
                "with --kv-cache"
            )
        self.layers = [layers[i] for i in sorted(layers)]
        self.mask_input = next(
            (
                n
                for n, m in inputs.items()
                if "mask" in n and any(d == "total_sequence" for d in m.shape)
            ),
            None,
        )
        self.shared = PAST_LENGTH in inputs
        known = {self.token_input, self.mask_input, PAST_LENGTH} | {
            m.name for layer in self.layers for m in layer.values()
        }
        self.extra_inputs = [n for n in inputs if n not in known]
        self.logits_output = session.output_names[0]
        encoder_file = session.path.parent / ENCODER_FILE
        self.encoder = None
        if encoder_file.is_file():
            self.encoder = Session(encoder_file, session.providers, threads=session.threads)
            self.encoder_inputs = list(self.encoder.input_names)
        self._past_dtype = {
            m.name: _numpy_dtype(m.type) for layer in self.layers for m in layer.values()
        }
        self.max_positions = session.max_positions  # None: the artifact states no limit

    def check_positions(self, needed: int, what: str) -> None:
        """Refuse, before ONNX Runtime runs, more positions than the model supports."""
        if self.max_positions is not None and needed > self.max_positions:
            raise TfgraphError(
                f"{what} needs {needed} positions but the model supports {self.max_positions} "
                "(max_positions in manifest.json); shorten the prompt or generate fewer tokens"
            )

    def encode(self, inputs: dict[str, np.ndarray]) -> dict[str, object]:
        """Encoder-decoder artifacts: the cross-attention keys and values, as ``OrtValue``
        objects to bind at every step (empty for a decoder-only artifact)."""
        if self.encoder is None:
            return {}
        binding = self.encoder.ort_session.io_binding()
        for name in self.encoder_inputs:
            if name not in inputs:
                raise TfgraphError(f"the encoder needs input '{name}'")
            value = self.encoder.check_input(name, inputs[name])
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for name in self.encoder.output_names:
            binding.bind_output(name, "cpu")
        self.encoder.ort_session.run_with_iobinding(binding)
        return dict(zip(self.encoder.output_names, binding.get_outputs(), strict=True))

    def empty_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache for ``batch`` rows; a shared-buffer artifact preallocates room for
        ``capacity`` positions (prompt + new tokens), once."""
        import onnxruntime as ort

        values = {}
        room = capacity if self.shared else 0
        for layer in self.layers:
            for meta in layer.values():
                heads, size = meta.shape[1], meta.shape[3]
                empty = np.zeros((batch, heads, room, size), self._past_dtype[meta.name])
                values[meta.name] = ort.OrtValue.ortvalue_from_numpy(empty)
        return KVCache(values, 0, capacity if self.shared else None)

    def step(
        self,
        tokens: np.ndarray,
        cache: KVCache,
        mask: np.ndarray | None = None,
        extra: dict[str, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, KVCache]:
        """Run the new ``tokens`` (batch, T) on ``cache``; returns (logits, next cache)."""
        new = tokens.shape[1]
        self.check_positions(cache.length + new, f"past {cache.length} + {new} new tokens")
        if cache.capacity is not None and cache.length + new > cache.capacity:
            raise TfgraphError(
                f"the KV cache holds {cache.capacity} positions but {cache.length + new} are "
                "needed; allocate it with a larger capacity"
            )
        binding = self.session.ort_session.io_binding()
        if self.shared:
            binding.bind_cpu_input(PAST_LENGTH, np.array([cache.length], np.int64))
        binding.bind_cpu_input(self.token_input, np.ascontiguousarray(tokens, np.int64))
        if self.mask_input is not None:
            if mask is None:
                raise TfgraphError(f"the model needs '{self.mask_input}' over past + new tokens")
            binding.bind_cpu_input(self.mask_input, np.ascontiguousarray(mask, np.int64))
        for name in self.extra_inputs:
            if extra is None or name not in extra:
                raise TfgraphError(f"the model also needs input '{name}'")
            if isinstance(extra[name], np.ndarray):
                binding.bind_cpu_input(name, np.ascontiguousarray(extra[name]))
            else:  # an OrtValue (cross-attention K/V from encode()): bound without a copy
                binding.bind_ortvalue_input(name, extra[name])
        for name, value in cache.values.items():
            binding.bind_ortvalue_input(name, value)
        outputs = self.session.output_names
        for name in outputs:
            past = name.replace("present.", "past_key_values.", 1)
            if self.shared and name.startswith("present.") and past in cache.values:
                binding.bind_ortvalue_output(name, cache.values[past])  # appended in place
            else:
                binding.bind_output(name, "cpu")
        self.session.ort_session.run_with_iobinding(binding)
        values = dict(zip(outputs, binding.get_outputs(), strict=True))
        logits = values.pop(self.logits_output).numpy()
        if self.shared:
            return logits, KVCache(cache.values, cache.length + new, cache.capacity)
        next_values = {
            name.replace("present.", "past_key_values.", 1): value
            for name, value in values.items()
            if name.startswith("present.")
        }
        return logits, KVCache(next_values, cache.length + new)


def _numpy_dtype(ort_type: str):
    return {"tensor(float)": np.float32, "tensor(float16)": np.float16}.get(ort_type, np.float32)


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


def choose(logits: np.ndarray, config: GenerationConfig, rng: np.random.Generator) -> np.ndarray:
    """Next token per row from (batch, vocab) logits."""
    if not config.do_sample:
        return logits.argmax(-1)
    scores = logits.astype(np.float64) / config.temperature
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
    return np.array([rng.choice(probs.shape[-1], p=row) for row in probs])


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
    config = config or GenerationConfig()
    config.check()
    ids, mask = left_pad(prompts, config.pad_token_id)
    if decoder.mask_input is None and len({len(p) for p in prompts}) > 1:
        logger.warning(
            "prompts differ in length and the model has no attention_mask input: "
            "the shorter ones see %d pad token(s)",
            ids.shape[1] - min(len(p) for p in prompts),
        )
    # the last new token is returned, never fed back: prompt + max_new_tokens - 1 positions
    decoder.check_positions(
        ids.shape[1] + config.max_new_tokens - 1,
        f"a {ids.shape[1]}-token prompt with {config.max_new_tokens} new tokens",
    )
    rng = np.random.default_rng(config.seed)
    batch = ids.shape[0]
    if decoder.encoder is not None:  # once per prompt, not per step
        extra = {**(extra or {}), **decoder.encode(extra or {})}
    cache = decoder.empty_cache(batch, capacity=ids.shape[1] + config.max_new_tokens)
    done = np.zeros(batch, bool)
    result = Generation([[] for _ in range(batch)], prompt_lengths=[len(p) for p in prompts])
    tokens = ids
    for t in range(config.max_new_tokens):
        logits, cache = decoder.step(tokens, cache, mask, extra)
        last = logits[:, -1, :]
        if keep_logits:
            result.step_logits.append(last.copy())
        chosen = np.where(done, config.pad_token_id, choose(last, config, rng))
        for row in np.flatnonzero(~done):
            result.tokens[row].append(int(chosen[row]))
        if config.eos_token_id is not None:
            done |= chosen == config.eos_token_id
        if progress is not None:
            progress(t + 1)
        if done.all():
            break
        tokens = chosen[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
    return result
