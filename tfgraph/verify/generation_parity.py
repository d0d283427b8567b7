"""Greedy KV-cached generation against eager PyTorch full recompute, token for token.

The cached engine (:func:`tfgraph.runtime.generate` on a :class:`CachedDecoder`) decodes
``new_tokens`` tokens after each left-padded prompt; the reference reruns the eager module on
the whole padded prefix at every step. Each step's logits (the ones that chose a token) are
compared within a tolerance, and the chosen tokens must be equal.

Used by ``tests/e2e/test_generation_parity.py`` and the differential fuzzer
(:mod:`tfgraph.tools.fuzz`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tfgraph.progress import tick
from tfgraph.runtime import CachedDecoder, GenerationConfig, generate
from tfgraph.runtime.generate import left_pad
from tfgraph.sources import ModelSource
from tfgraph.verify.parity import FP32, Tolerance, compare


@dataclass
class GreedyComparison:
    """``tokens``: the cached engine's new tokens per row; ``want_tokens``: eager's;
    ``steps[t]``: :func:`tfgraph.verify.parity.compare` of the logits that chose token t."""

    tokens: list[list[int]]
    want_tokens: list[list[int]]
    steps: list[dict]
    engine_logits: list | None = None  # the engine's (batch, vocab) logits of each step

    @property
    def passed(self) -> bool:
        return self.tokens == self.want_tokens and all(r["passed"] for r in self.steps)

    def divergence(self) -> int | None:
        """The first step at which a row chose a different token (None: all equal)."""
        for step in range(min(len(t) for t in [*self.tokens, *self.want_tokens])):
            if any(g[step] != w[step] for g, w in zip(self.tokens, self.want_tokens, strict=True)):
                return step
        return None if self.tokens == self.want_tokens else 0

    def agrees_up_to_a_tie(self) -> bool:
        """Every step's logits within tolerance up to the first differing token, included.

        Logits within tolerance whose argmax differs are a near tie of the top two tokens:
        after it the two sides decode different prefixes, so later steps say nothing.
        """
        t = self.divergence()
        checked = self.steps if t is None else self.steps[: t + 1]
        return all(r["passed"] for r in checked)


def encoder_inputs(
    decoder: CachedDecoder, prompts: list[list[int]], pad: int = 0
) -> dict[str, np.ndarray]:
    """Encoder-decoder generation: the prompts, left-padded, feed the encoder (by the roles
    of the artifact's inputs)."""
    return decoder.encoder_feeds(*left_pad(prompts, pad))


def eager_greedy(
    source: ModelSource,
    decoder: CachedDecoder,
    prompts: list[list[int]],
    extra: dict[str, np.ndarray],
    new_tokens: int,
    pad: int = 0,
) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy decoding by full recompute: every step reruns the whole padded prefix.

    Returns the chosen tokens per row and each step's (batch, vocab) last-position logits.
    """
    if decoder.seq2seq:
        tokens = np.zeros((len(prompts), 1), np.int64)  # decoder start token 0
    else:
        tokens, _ = left_pad(prompts, pad)
    chosen, logits = [], []
    for step in range(new_tokens):
        tick("eager greedy tokens", step, new_tokens)
        inputs = {n: torch.from_numpy(v) for n, v in extra.items() if n in source.input_names}
        inputs[decoder.token_input] = torch.from_numpy(tokens)
        if decoder.mask_input is not None:  # the decoder's own padding mask, grown per token
            _, mask = left_pad(prompts, pad)
            grown = np.ones((len(prompts), tokens.shape[1] - mask.shape[1]), np.int64)
            inputs[decoder.mask_input] = torch.from_numpy(np.concatenate([mask, grown], 1))
        last = source.eager(inputs)[source.output_names[0]][:, -1].float().numpy()
        logits.append(last)
        chosen.append(last.argmax(-1))
        tokens = np.concatenate([tokens, chosen[-1][:, None]], axis=1)
    tick("eager greedy tokens", new_tokens, new_tokens)
    return np.stack(chosen, 1).tolist(), logits


def compare_greedy(
    source: ModelSource,
    decoder: CachedDecoder,
    prompts: list[list[int]],
    new_tokens: int,
    *,
    extra: dict[str, np.ndarray] | None = None,
    tolerance: Tolerance = FP32,
    pad: int = 0,
) -> GreedyComparison:
    """Generate ``new_tokens`` greedily with the cached ``decoder`` and by eager recompute."""
    extra = extra or {}
    config = GenerationConfig(max_new_tokens=new_tokens, pad_token_id=pad)
    got = generate(decoder, prompts, config, extra=extra, keep_logits=True)
    want_tokens, want_logits = eager_greedy(source, decoder, prompts, extra, new_tokens, pad)
    steps = [
        compare("logits", g, w, tolerance)
        for g, w in zip(got.step_logits, want_logits, strict=True)
    ]
    return GreedyComparison(got.tokens, want_tokens, steps, got.step_logits)


def forced_agreement(
    source: ModelSource,
    decoder: CachedDecoder,
    prompts: list[list[int]],
    tokens: list[list[int]],
    step_logits: list[np.ndarray],
    bound: float,
    pad: int = 0,
) -> dict:
    """The cached engine's greedy run judged on its own prefix (teacher forcing): one eager
    pass over each prompt followed by the engine's tokens gives eager's logits for exactly the
    prefixes the engine decoded, step by step. A step agrees when eager's argmax is the
    engine's token; it is a near tie when it is not, the two sides' logits at that step are
    within ``bound`` (the parity rule's allowed error) and eager's own margin for the engine's
    token (its top logit minus that token's) is at most twice their largest difference — the
    two sides differ by that much, so either choice is theirs. ``unexplained`` counts the rest:
    a real disagreement. Decoders only.

    Unlike :func:`compare_greedy` it keeps judging after a near tie parts the two sides'
    tokens, and it needs one eager pass instead of one per token."""
    if decoder.seq2seq:
        raise ValueError("forced_agreement judges decoders")
    steps = len(step_logits)
    logits = forced_logits(source, decoder, prompts, tokens, steps, pad=pad)
    equal = ties = 0
    worst_gap, worst_diff = 0.0, 0.0
    for t in range(steps):
        want = logits[t]
        got = np.asarray(step_logits[t], np.float64)
        diff = float(np.abs(got - want).max())
        worst_diff = max(worst_diff, diff)
        for row, chosen in enumerate(new[t] for new in tokens):
            gap = float(want[row].max() - want[row, chosen])
            if gap == 0.0:
                equal += 1
            elif diff <= bound and gap <= 2 * diff:
                ties += 1
                worst_gap = max(worst_gap, gap)
    total = steps * len(tokens)
    return {
        "steps": steps,
        "rows": len(tokens),
        "bound": bound,
        "equal": equal,
        "near_ties": ties,
        "unexplained": total - equal - ties,
        "max_logits_diff": worst_diff,
        "max_tie_margin": worst_gap,
    }


def forced_logits(
    source: ModelSource,
    decoder: CachedDecoder,
    prompts: list[list[int]],
    tokens: list[list[int]],
    steps: int,
    extra: dict[str, np.ndarray] | None = None,
    pad: int = 0,
) -> np.ndarray:
    """Eager's logits for the prefixes a cached run decoded, in one pass (teacher forcing):
    (steps, batch, vocab), row t the logits after each prompt and the first t of ``tokens``.
    A decoder's prompts are left-padded; an encoder-decoder's feed its encoder through
    ``extra`` and its decoder starts from token 0, as :func:`eager_greedy` runs them."""
    rows = [list(t[: steps - 1]) for t in tokens]
    if decoder.seq2seq:
        ids = np.array([[0, *r] for r in rows], np.int64)
        mask = None
    else:
        ids, mask = left_pad([list(p) + r for p, r in zip(prompts, rows, strict=True)], pad)
    inputs = {n: torch.from_numpy(v) for n, v in (extra or {}).items() if n in source.input_names}
    inputs[decoder.token_input] = torch.from_numpy(ids)
    if decoder.mask_input is not None and mask is not None:
        inputs[decoder.mask_input] = torch.from_numpy(mask)
    logits = source.eager(inputs)[source.output_names[0]].float().numpy()
    first = ids.shape[1] - steps  # the position whose logits chose the first new token
    return np.moveaxis(logits[:, first:], 1, 0)
