"""Drafters for speculative decoding (issue 49): what proposes the tokens the target verifies.

A drafter's :meth:`propose` takes the request's tokens so far (prompt + emitted) and ``k``, and
returns ``(tokens, probs)``: up to ``k`` drafted tokens, and their proposal distributions
((len(tokens), vocab), after the sampling transform) or ``None`` when the drafter is
deterministic (``q`` one-hot, :func:`tfgraph.runtime.speculative.accept_sampled`).

- :class:`PromptLookup` (no model): the longest n-gram (``max_ngram`` down to ``min_ngram``
  tokens) ending the context is looked up earlier in the context, latest match first, and the
  tokens that followed it are proposed (prompt lookup decoding; llama.cpp's ``llama-lookup``,
  onnxruntime-genai and transformers' ``prompt_lookup_num_tokens``). Free, and right where the
  output copies from the prompt (code edits, summaries that quote, retrieval answers).
- :class:`DraftModel`: a smaller tfgraph artifact with the same tokenizer, with its own cache
  (:class:`~tfgraph.runtime.speculative_cache.TrackedCache`, rolled back to the common prefix of
  what it holds and the context before each proposal). It drafts greedily, or samples with the
  request's transform and keeps each position's distribution.
"""

from __future__ import annotations

import filecmp
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tfgraph.errors import TfgraphError
from tfgraph.runtime.speculative import probabilities
from tfgraph.runtime.speculative_cache import TrackedCache, check_speculative

logger = logging.getLogger(__name__)

__all__ = ["DraftModel", "PromptLookup", "check_same_tokenizer"]


class PromptLookup:
    """Propose the continuation of the latest earlier occurrence of the context's last
    n-gram (``max_ngram`` tokens, then shorter down to ``min_ngram``); deterministic."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise TfgraphError(
                f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            )
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, prompt: Sequence[int], capacity: int) -> None:
        """A new request (nothing to prepare: the context is all it reads)."""

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], None]:
        ids = np.asarray(context, np.int64)
        n_ctx = len(ids)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail = ids[n_ctx - n :]
            # windows starting at 0 .. n_ctx - n - 1 (the tail itself excluded)
            windows = np.lib.stride_tricks.sliding_window_view(ids[: n_ctx - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                found = ids[start : start + k]
                if len(found):
                    return [int(t) for t in found], None
        return [], None


def check_same_tokenizer(target: Path, draft: Path, target_vocab: int, draft_vocab: int) -> None:
    """Refuse, in one line, a draft whose vocabulary or ``tokenizer/tokenizer.json`` differs
    from the target's (its token ids would mean other text)."""
    if target_vocab != draft_vocab:
        raise TfgraphError(
            f"the draft's vocabulary ({draft_vocab}) differs from the target's ({target_vocab}); "
            "a draft must share the target's tokenizer"
        )
    files = [Path(p) / "tokenizer" / "tokenizer.json" for p in (target, draft)]
    present = [f.is_file() for f in files]
    if any(present) and not (all(present) and filecmp.cmp(*files, shallow=False)):
        raise TfgraphError(
            f"the draft's tokenizer.json ({files[1]}) differs from the target's ({files[0]}); "
            "a draft must share the target's tokenizer"
        )


def vocab_of(decoder) -> int:
    """The vocabulary of a decoder's logits (its last static dim)."""
    from tfgraph import contract

    port = decoder.session.signature.output(contract.LOGITS) or decoder.session.signature.outputs[0]
    size = port.shape[-1] if port.shape else None
    if not isinstance(size, int):
        raise TfgraphError(f"'{decoder.session.path}' states no static vocabulary on its logits")
    return size


class DraftModel:
    """A smaller artifact's decoder as a drafter (module doc). ``target``: the target's decoder
    (checked: the same vocabulary and tokenizer.json). ``seed``: the draft's own sampling.
    ``min_probability``: greedy drafting stops early (after at least one token) where the
    draft's own top probability falls below it (llama.cpp's ``--draft-p-min``): an unsure
    draft is likely rejected, and each draft step costs time."""

    def __init__(
        self, decoder, target=None, *, seed: int | None = None, min_probability: float = 0.0
    ) -> None:
        check_speculative(decoder, "the draft")
        if target is not None:
            check_same_tokenizer(
                _artifact(target), _artifact(decoder), vocab_of(target), vocab_of(decoder)
            )
        self.decoder = decoder
        self.cache: TrackedCache | None = None
        self.config = None  # the request's GenerationConfig (set by the loop)
        self.rng = np.random.default_rng(seed)
        self.min_probability = min_probability

    def start(self, prompt: Sequence[int], capacity: int) -> None:
        """A new request: a fresh cache with room for ``capacity`` positions."""
        self.cache = TrackedCache(self.decoder, capacity)

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], np.ndarray | None]:
        if self.cache is None:
            raise TfgraphError("DraftModel.start(prompt, capacity) first")
        sample = self.config is not None and self.config.do_sample
        logits = self.cache.sync(context)
        tokens, probs = [], []
        for i in range(k):
            if sample:
                q = probabilities(logits[None], self.config)[0]
                token = int(self.rng.choice(q.shape[0], p=q))
                probs.append(q)
            else:
                token = int(np.argmax(logits))
                if i and self.min_probability and _top_probability(logits) < self.min_probability:
                    break
            tokens.append(token)
            if i + 1 < k:  # the last draft is not run: the target's verdict decides what stays
                logits = self.cache.feed([token])[-1]
        return tokens, (np.stack(probs) if sample else None)


def _top_probability(logits: np.ndarray) -> float:
    """The softmax's largest probability of one row of logits."""
    shifted = np.asarray(logits, np.float64) - np.max(logits)
    return float(1.0 / np.exp(shifted).sum())


def _artifact(decoder) -> Path:
    path = Path(decoder.session.path)
    return path if path.is_dir() else path.parent
