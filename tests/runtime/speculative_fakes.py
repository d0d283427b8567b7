"""Toy decoders for the speculative decoding tests: logits of the next token are
``W[last] + U[previous]`` (a second-order table over a tiny vocabulary), so every distribution
can be enumerated exactly. :class:`SharedFake` keeps its tokens in a preallocated buffer read up
to the cache's length (as GroupQueryAttention reads a shared KV buffer); :class:`RecurrentFake`
carries (previous, last) as a state replaced each step (as a Mamba layer's)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from tfgraph import contract
from tfgraph.runtime.runner import KVCache

NONE = -1  # no previous token: U's last row


def tables(vocab: int, seed: int, scale: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return scale * rng.standard_normal((vocab, vocab)), rng.standard_normal((vocab + 1, vocab))


class _Fake:
    def __init__(self, w: np.ndarray, u: np.ndarray, roles: tuple, shared: bool) -> None:
        self.w, self.u = w, u
        self.vocab = w.shape[1]
        self.encoder, self.extra_inputs, self.max_positions = None, [], None
        logits = SimpleNamespace(shape=["batch", "sequence", self.vocab])
        signature = SimpleNamespace(
            inputs_with=lambda *wanted: [r for r in roles if r in wanted],
            shared_buffer=shared,
            output=lambda role: logits,
            outputs=[logits],
        )
        self.session = SimpleNamespace(signature=signature, path=Path("/nonexistent/fake"))
        self.steps = 0  # step calls
        self.tokens_run = 0  # positions run

    def check_positions(self, needed: int, what: str) -> None:
        pass

    def logits(self, previous: int, last: int) -> np.ndarray:
        return self.w[last] + self.u[previous]

    def reference(self, prompt: list[int], n: int) -> list[int]:
        """Plain greedy decoding: ``n`` tokens."""
        ids = list(prompt)
        for _ in range(n):
            previous = ids[-2] if len(ids) > 1 else NONE
            ids.append(int(np.argmax(self.logits(previous, ids[-1]))))
        return ids[len(prompt) :]


class SharedFake(_Fake):
    """Tokens in a preallocated buffer; a step writes at ``length`` and reads up to it."""

    def __init__(self, w, u) -> None:
        super().__init__(w, u, (contract.PAST_KEY,), shared=True)

    def empty_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache({(contract.PAST_KEY, 0): np.full(capacity, -7)}, 0, capacity)

    def step(self, tokens, cache, mask=None, extra=None):
        buffer, start = cache.values[(contract.PAST_KEY, 0)], cache.length
        new = np.asarray(tokens)[0]
        assert start + len(new) <= cache.capacity
        buffer[start : start + len(new)] = new  # in place, as the kernel appends
        rows = []
        for pos in range(start, start + len(new)):
            previous = int(buffer[pos - 1]) if pos else NONE
            rows.append(self.logits(previous, int(buffer[pos])))
        self.steps += 1
        self.tokens_run += len(new)
        return np.stack(rows)[None], KVCache(cache.values, start + len(new), cache.capacity)


class RecurrentFake(_Fake):
    """(previous, last) carried as a state replaced by a fresh array each step."""

    def __init__(self, w, u) -> None:
        super().__init__(w, u, (contract.PAST_RECURRENT_STATE,), shared=False)

    def empty_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache({(contract.PAST_RECURRENT_STATE, 0): np.array([NONE, NONE])}, 0)

    def step(self, tokens, cache, mask=None, extra=None):
        previous, last = cache.values[(contract.PAST_RECURRENT_STATE, 0)].tolist()
        rows = []
        for token in np.asarray(tokens)[0].tolist():
            previous, last = last, token
            rows.append(self.logits(previous, last))
        self.steps += 1
        self.tokens_run += np.shape(tokens)[1]
        state = {(contract.PAST_RECURRENT_STATE, 0): np.array([previous, last])}
        return np.stack(rows)[None], KVCache(state, cache.length + np.shape(tokens)[1])
