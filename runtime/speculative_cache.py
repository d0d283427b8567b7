"""One row's cache that can be rolled back: what speculative decoding needs from a cache
(issue 49). :class:`TrackedCache` keeps a decoder's :class:`~tfgraph.runtime.runner.KVCache`
together with the tokens it holds, feeds new tokens, and truncates to fewer.

- A shared preallocated buffer (``kv_layout`` ``shared``, the default ort export, int8 KV
  included): the kernel appends at the row's past length and never reads past it, so rolling
  back is a smaller ``length``; the positions past it are overwritten by the next step.
- Recurrent layers' states (:data:`tfgraph.contract.STATE_ROLES`) are replaced each step and
  cannot be cut: the state before each feed is kept (the runner's values are fresh outputs,
  never written in place, so a reference is a snapshot) and a rollback restores the latest one
  at or before the new length and re-runs the tokens between.
- A per-step past + present cache (``kv_layout`` ``concat``) is refused in one line: its
  presents are the runner's values, which this runtime does not slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from tfgraph import contract
from tfgraph.errors import TfgraphError

_KV_ROLES = (contract.PAST_KEY, contract.PAST_VALUE, contract.PAST_TOKENS)
_SNAPSHOTS = 32  # states kept for rollback: more than any draft length


def check_speculative(decoder, what: str = "the target") -> None:
    """Refuse, in one line, a decoder whose cache or inputs speculative decoding cannot roll
    back or feed (a concat cache, an encoder-decoder, a vision-language decoder)."""
    signature = decoder.session.signature
    if decoder.encoder is not None or decoder.extra_inputs:
        names = ", ".join(decoder.extra_inputs) or "an encoder"
        raise TfgraphError(
            f"speculative decoding takes decoder-only text models; {what} also needs {names}"
        )
    has_kv = bool(signature.inputs_with(*_KV_ROLES))
    if has_kv and not signature.shared_buffer:
        raise TfgraphError(
            f"speculative decoding rolls the KV cache back by its length, which needs a "
            f"shared-buffer cache; re-export {what} with the default kv_layout (shared)"
        )


class TrackedCache:
    """A one-row cache of ``decoder`` with room for ``capacity`` positions and the tokens it
    holds (:attr:`tokens`)."""

    def __init__(self, decoder, capacity: int) -> None:
        self.decoder = decoder
        self.cache = decoder.empty_cache(1, capacity)
        self.tokens: list[int] = []
        self.recurrent = bool(decoder.session.signature.inputs_with(*contract.STATE_ROLES))
        self._snapshots: list[tuple[int, dict]] = []  # (length, values) before a feed
        self.reruns = 0  # tokens re-run to restore a recurrent state

    def __len__(self) -> int:
        return len(self.tokens)

    def feed(self, tokens: Sequence[int]) -> np.ndarray:
        """Run ``tokens`` after those held; (len(tokens), vocab) logits."""
        if not tokens:
            raise TfgraphError("feed needs at least one token")
        if self.recurrent:
            self._snapshots.append((len(self.tokens), dict(self.cache.values)))
            del self._snapshots[:-_SNAPSHOTS]
        ids = np.asarray([list(tokens)], np.int64)
        logits, self.cache = self.decoder.step(ids, self.cache)
        self.tokens.extend(int(t) for t in tokens)
        return logits[0]

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens held (a rollback); a no-op at the current length."""
        if not 0 <= length <= len(self.tokens):
            raise TfgraphError(f"cannot keep {length} of {len(self.tokens)} cached tokens")
        if length == len(self.tokens):
            return
        if not self.recurrent:
            self.cache = replace(self.cache, length=length)
            del self.tokens[length:]
            return
        kept = [s for s in self._snapshots if s[0] <= length]
        if not kept:
            raise TfgraphError(
                f"cannot roll a recurrent state back to {length} tokens: no snapshot that early"
            )
        start, values = kept[-1]
        self._snapshots = self._snapshots[: len(kept) - 1]
        redo = self.tokens[start:length]
        self.cache = replace(self.cache, values=values, length=start)
        del self.tokens[start:]
        if redo:
            self.reruns += len(redo)
            self.feed(redo)

    def sync(self, context: Sequence[int]) -> np.ndarray:
        """Bring the held tokens to ``context`` (rolled back to their common prefix, then the
        rest fed; at least the last token is always run) and return the logits after it."""
        common = 0
        limit = min(len(self.tokens), len(context) - 1)
        while common < limit and self.tokens[common] == context[common]:
            common += 1
        self.truncate(common)
        return self.feed(list(context[common:]))[-1]
