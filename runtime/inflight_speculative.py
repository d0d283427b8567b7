"""Speculative decoding in the in-flight batcher (issue 49): while few requests decode, each
drafts up to ``k`` tokens and one step of the target verifies them.

:class:`SpeculativeBatcher` is a :class:`~tfgraph.runtime.inflight.SlotBatcher` whose decoding
step verifies drafts: while at most ``rows`` requests decode, each one's drafter
(:mod:`tfgraph.runtime.drafters`: prompt lookup, shared by every slot, or a draft artifact, one
:class:`DraftModel` per slot over one draft session) proposes ``d1..dk`` after its prompt and
tokens so far, and the target runs ``[last, d1..dk]`` over that slot's row at its own past
length (a (1, k + 1) step); its drafts are accepted by
:func:`~tfgraph.runtime.speculative.accept_greedy` (or the rejection rule,
:func:`~tfgraph.runtime.speculative.accept_sampled`, with the request's own generator), and its
length becomes what it keeps (``last`` and the accepted drafts): on the shared buffer the
positions past a row's length are never read, so that is the whole rollback. A step so gives a
slot one to ``k + 1`` tokens, which :meth:`~SlotBatcher.advance` returns in order (the engines
stream them one by one). Rows without drafts (none found, or more than ``rows`` decoding) take
the plain batched one-token step.

Why one row per verify step: ONNX Runtime's GroupQueryAttention (CPU, 1.32) refuses several new
tokens over a past for a batch of more than one ("batch_size must be 1 when sequence_length > 1
and past context is given"), so each verifying row is a step of its own, reading the weights
again: it pays while few rows decode (a one-token step of 16 rows costs about 3 of one row:
docs/serving.md), which is where a request waits on its own tokens.

``k`` is clamped per row so that a request never runs past its ``max_new_tokens`` (nor its
slot). Greedy tokens are plain decoding's (up to argmax ties in fp32 noise); sampled tokens are
distributed as the target's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from tfgraph.errors import TfgraphError
from tfgraph.runtime.inflight import Request, SlotBatcher
from tfgraph.runtime.speculative import (
    DraftLength,
    SpeculativeStats,
    accept_greedy,
    accept_sampled,
)

logger = logging.getLogger(__name__)

PROMPT_LOOKUP = "prompt-lookup"


def open_drafter(spec: str | Path, target, threads: int | None = None):
    """``prompt-lookup`` or a draft artifact's directory: a factory of per-slot drafters (a
    shared :class:`PromptLookup`; a :class:`DraftModel` per slot over one draft decoder)."""
    from tfgraph.runtime.drafters import DraftModel, PromptLookup

    if str(spec) == PROMPT_LOOKUP:
        lookup = PromptLookup()
        return lambda: lookup
    from tfgraph.runtime import open_runner
    from tfgraph.runtime.generate import CachedDecoder

    path = Path(spec)
    if not path.is_dir():  # a draft copied beside the artifact (tfgraph triton's repository)
        here = Path(target.session.path)
        path = (here if here.is_dir() else here.parent) / spec
    if not path.is_dir():
        raise TfgraphError(
            f"--speculative takes {PROMPT_LOOKUP} or a draft artifact's directory, not '{spec}'"
        )
    draft = CachedDecoder(
        open_runner(path, spinning=False, **({"threads": threads} if threads else {}))
    )
    DraftModel(draft, target)  # refuses a draft of another tokenizer now, once
    return lambda: DraftModel(draft)  # per request: checked above, no tokenizer files re-read


class SpeculativeBatcher(SlotBatcher):
    """A :class:`SlotBatcher` that decodes by drafting and verifying (module doc).
    ``drafter``: a factory of a request's drafter (:func:`open_drafter`); ``k``: drafts per
    step (``adaptive``: grown and shrunk per request by its acceptance); ``rows``: the most
    decoding requests at which it drafts (more take plain batched steps)."""

    def __init__(
        self, decoder, slots, capacity, *, drafter, k: int = 4, adaptive=False, rows: int = 2,
        **options,
    ) -> None:  # fmt: skip
        from tfgraph.runtime.speculative_cache import check_speculative

        super().__init__(decoder, slots, capacity, **options)
        check_speculative(decoder)
        DraftLength(k, adaptive, k_max=max(k, 8))  # a bad k fails here, not at a request
        self.new_drafter, self.k, self.adaptive, self.rows = drafter, k, adaptive, rows
        self.drafters: dict[int, tuple] = {}  # slot -> (drafter, DraftLength)
        self.stats = SpeculativeStats()

    def admit(self, prompt, config, seed=None, start_token: int = 0, extra=None) -> Request:
        request = super().admit(prompt, config, seed, start_token, extra)
        if request.finished:  # its one token came with its prefill
            return request
        drafter = self.new_drafter()
        if hasattr(drafter, "config"):
            drafter.config = config
        drafter.start(request.prompt, self.capacity)
        length = DraftLength(self.k, self.adaptive, k_max=max(self.k, 8))
        self.drafters[request.slot] = (drafter, length)
        return request

    def _drafts(self, decoding: dict[int, Request]) -> dict[int, tuple[list[int], object]]:
        """Each decoding slot's drafts and their probabilities (None: deterministic)."""
        out = {}
        for slot, request in decoding.items():
            drafter, length = self.drafters[slot]
            k = min(length.k, request.config.max_new_tokens - len(request.tokens) - 1)
            draft, probs = [], None
            if k > 0:
                draft, probs = drafter.propose(request.prompt + request.tokens, k)
            out[slot] = (list(draft[:k]), probs)
        return out

    def _decode(self) -> dict[int, list[int]]:
        decoding = {slot: r for slot, r in self.active.items() if r.tokens}
        drafts = self._drafts(decoding) if len(decoding) <= self.rows else {}
        drafts = {slot: d for slot, d in drafts.items() if d[0]}
        plain = {slot: r for slot, r in decoding.items() if slot not in drafts}
        # first: a drafting row's token lands where its verify step writes it again
        out = super()._decode(plain) if plain else {}
        for slot, (draft, probs) in drafts.items():
            request = decoding[slot]
            tokens = np.asarray([[request.last, *draft]], np.int64)
            out[slot] = self._accept(request, draft, probs, self._run(request, tokens))
        return out

    def _accept(self, request: Request, draft: list[int], probs, logits: np.ndarray) -> list[int]:
        """The request's tokens out of its verify rows: accepted drafts and one more, each
        appended (ending it at its limit or EOS); its length past the kept ones."""
        rows = logits[: len(draft) + 1]
        if request.config.do_sample:
            probs = None if probs is None else probs[: len(draft)]
            out = accept_sampled(draft, probs, rows, request.config, request.rng)
        else:
            out = accept_greedy(draft, rows)
        self.stats.record(len(draft), len(out))
        _, length = self.drafters[request.slot]
        if draft:
            length.update(len(draft), len(out) - 1)
        # the verify step counted ``last`` and every draft: its row keeps the accepted ones
        request.length -= len(draft) + 1 - len(out)
        eos, given = request.config.eos_token_id, []
        for i, token in enumerate(out):
            if request.logits is not None:
                request.logits.append(rows[i].copy())
            request.tokens.append(token)
            given.append(token)
            if len(request.tokens) >= request.config.max_new_tokens or token == eos:
                self.release(request.slot)
                break
        return given

    def release(self, slot: int) -> None:
        super().release(slot)
        self.drafters.pop(slot, None)


def make_batcher(
    decoder, slots: int, capacity: int, *, speculative=None, speculative_k: int = 4,
    threads: int | None = None, **options,
) -> SlotBatcher:  # fmt: skip
    """The servers' batcher: a :class:`SpeculativeBatcher` drafting with ``speculative``
    (``prompt-lookup`` or a draft artifact's directory; ``threads``: its session's), else a
    plain :class:`SlotBatcher`; ``options``: the batcher's."""
    if not speculative:
        return SlotBatcher(decoder, slots, capacity, **options)
    drafter = open_drafter(speculative, decoder, threads)
    batcher = SpeculativeBatcher(
        decoder, slots, capacity, drafter=drafter, k=speculative_k, **options
    )
    logger.info("speculative decoding: %s, k = %d", speculative, speculative_k)
    return batcher


def draft_artifact(speculative: str | None, k: int) -> Path | None:
    """The draft artifact ``--speculative`` names (None: prompt lookup, or none); a one-line
    error when it is neither, or ``k`` < 1."""
    if k < 1:
        raise TfgraphError(f"--speculative-k must be >= 1, got {k}")
    if not speculative or str(speculative) == PROMPT_LOOKUP:
        return None
    if not (Path(speculative) / "manifest.json").is_file():
        raise TfgraphError(
            f"--speculative takes {PROMPT_LOOKUP} or a draft artifact's directory, not "
            f"'{speculative}'"
        )
    return Path(speculative).resolve()
