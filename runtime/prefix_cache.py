"""Prefix caching over the in-flight batcher's slot cache: requests sharing a prompt prefix
(a system prompt, a chat history) prefill it once.

The idea is vLLM's automatic prefix caching, over :class:`tfgraph.runtime.SlotBatcher`'s
buffer of slot rows:

- a prompt is cut into **blocks** of ``block`` tokens (16 by default); block i's key is a
  chained hash: its parent's key and its own tokens, so equal keys mean equal prefixes (not
  just equal blocks), and a lookup walks the chain from the first block;
- after a request's prefill, the K/V rows of its prompt's full blocks (every layer, keys and
  values, the cache's own dtype: an int8 KV cache's int8) are **copied out** of its slot row
  into the store (blocks already there are only touched);
- a new request whose prompt starts with stored blocks gets them **copied into** its slot row
  at the same positions, so the K/V are the ones its own prefill would have written, and its
  prefill starts after them. Full blocks only, and at least one prompt token is left to
  prefill, so its first token's logits come from the graph as without reuse;
- the store holds at most ``budget_bytes``: past it the **least recently used** blocks go
  first (a hit touches its chain from the last block to the first, so a shared root outlives
  its leaves and a chain never loses its head before its tail).

Only the K/V a position's own prefix determines is reused, which holds for every decoder the
batcher serves except where a slot's row carries more than that: recurrent states (replaced
each step, not per position), an encoder-decoder's cross K/V (the encoder's prompt, not the
decoder's tokens), a vision-language prompt (an image's placeholder tokens are equal for
different images). :func:`prefix_cache_support` says which and the batcher logs it.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tfgraph import contract
from tfgraph.errors import TfgraphError

logger = logging.getLogger(__name__)

DEFAULT_BLOCK = 16


def prefix_cache_support(host: Mapping | None, encoder: bool, prompt_inputs: bool) -> str | None:
    """None when a batcher's slot rows can be reused by prefix (``host``: its cache's arrays
    by (role, layer); ``encoder``: it holds cross K/V per slot; ``prompt_inputs``: its step
    graph takes per-prompt inputs), else why not (one line)."""
    if host is None:
        return "the cache is not a preallocated buffer of rows"
    if any(role in contract.STATE_ROLES for role, _ in host):
        return "a recurrent layer's state is replaced each step, not kept per position"
    if encoder:
        return "an encoder-decoder's slot K/V depend on its encoder prompt, not its tokens"
    if prompt_inputs:
        return "a vision-language prompt's image tokens are equal for different images"
    return None


@dataclass
class PrefixStats:
    """What the cache did: ``lookups`` (requests looked up), ``hits`` (requests that reused
    at least one block), ``tokens_reused`` (prompt tokens not prefilled), ``blocks_stored``,
    ``evictions`` (blocks dropped for the budget)."""

    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    blocks_stored: int = 0
    evictions: int = 0


class PrefixCache:
    """Blocks of K/V rows by chained hash, at most ``budget_bytes`` of them (module doc)."""

    def __init__(self, budget_bytes: int, block: int = DEFAULT_BLOCK) -> None:
        if block < 1 or budget_bytes < 0:
            raise TfgraphError(
                f"a prefix cache needs a block of >= 1 token and a budget >= 0 bytes, got "
                f"{block} and {budget_bytes}"
            )
        self.block, self.budget = block, int(budget_bytes)
        self.blocks: OrderedDict[bytes, dict] = OrderedDict()  # key -> {(role, layer): rows}
        self.bytes = 0
        self.stats = PrefixStats()

    def keys(self, prompt: Sequence[int], blocks: int) -> list[bytes]:
        """The chained keys of the first ``blocks`` full blocks of ``prompt``."""
        keys, parent = [], b""
        for i in range(blocks):
            ids = np.asarray(prompt[i * self.block : (i + 1) * self.block], np.int64)
            parent = hashlib.blake2b(parent + ids.tobytes(), digest_size=16).digest()
            keys.append(parent)
        return keys

    def _reusable(self, prompt: Sequence[int]) -> list[bytes]:
        """The stored chain ``prompt`` starts with: full blocks, one token left to prefill."""
        chain = []
        for key in self.keys(prompt, (len(prompt) - 1) // self.block):
            if key not in self.blocks:
                break
            chain.append(key)
        return chain

    def load(self, prompt: Sequence[int], host: Mapping, slot: int) -> int:
        """Copy the stored blocks ``prompt`` starts with into row ``slot`` of the cache's
        arrays ``host``; the prompt tokens they hold (0: none)."""
        chain = self._reusable(prompt)
        self.stats.lookups += 1
        for i, key in enumerate(chain):
            at = slice(i * self.block, (i + 1) * self.block)
            for name, rows in self.blocks[key].items():
                host[name][slot, :, at] = rows
        self._touch(chain)
        reused = len(chain) * self.block
        if reused:
            self.stats.hits += 1
            self.stats.tokens_reused += reused
        return reused

    def store(self, prompt: Sequence[int], host: Mapping, slot: int) -> None:
        """Copy the full blocks of ``prompt`` (prefilled in row ``slot``) out of the cache's
        arrays ``host``, those not stored yet; evict past the budget."""
        if not self.budget:
            return
        chain = self.keys(prompt, len(prompt) // self.block)
        for i, key in enumerate(chain):
            if key in self.blocks:
                continue
            at = slice(i * self.block, (i + 1) * self.block)
            rows = {name: array[slot, :, at].copy() for name, array in host.items()}
            self.blocks[key] = rows
            self.bytes += sum(r.nbytes for r in rows.values())
            self.stats.blocks_stored += 1
        self._touch(chain)
        while self.bytes > self.budget and self.blocks:
            _, rows = self.blocks.popitem(last=False)  # the least recently used
            self.bytes -= sum(r.nbytes for r in rows.values())
            self.stats.evictions += 1

    def _touch(self, chain: list[bytes]) -> None:
        """Most recently used: the chain's root last, so leaves are evicted first."""
        for key in reversed(chain):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def clear(self) -> None:
        self.blocks.clear()
        self.bytes = 0
