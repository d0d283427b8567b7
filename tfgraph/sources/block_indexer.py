"""Block-sparse token selection (Qwen4-Exp's QSA indexer) traced as dense masked tensors.

Qwen4-Exp's ``Qwen4ExpTextQSAIndexer._select_tokens`` picks, for every query, the keys it may
attend to: its visible keys (``torch.nonzero`` of the mask row), cut in order into blocks of
``compress_ratio`` tokens; each complete block's keys are mean-pooled, RMS-normed and rotated
at the block's first token; the blocks score ``relu(q · k_block)`` summed over the indexer's
heads; the ``block_topk`` best complete blocks and the incomplete last block (the tail) are
kept. It loops over batch and queries in Python and sizes tensors by the number of visible
keys: ``if num_complete_blocks > 0`` branches on tensor values, which torch.export cannot
trace.

While tracing, each indexer's ``_select_tokens`` is this module's dense equivalent, with the
same result. The keys are put in order once per batch row (a key's rank among the keys some
query sees: ``cumsum``; the ranked keys' positions by ``ScatterElements``), pooled in blocks of
``compress_ratio`` (``Gather`` + mean over each block), normed and rotated as the model does;
every query scores every block (one ``MatMul``), blocks a query does not see complete score
``-inf``, ``TopK(block_topk)`` picks among them (columns of ``-inf`` appended so that ``k``
is a constant), the picks are scattered into a block mask, and each visible key takes its
block's pick (``Gather``) or is in the query's tail. The mask is the one the model builds:
causal and padding (``create_causal_mask``), where what a query sees is a prefix, in key
order, of the keys the last query sees, so that a key's rank in every query's row is its rank
among all visible keys; blocks are then shared by all queries. Eager PyTorch (the parity
reference) runs the original.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import Iterator

import torch

from tfgraph.sources.instance_methods import instance_methods

logger = logging.getLogger(__name__)

_ATTRS = ("compress_ratio", "block_topk", "index_head_dim", "k_layernorm", "_select_tokens")


def _is_block_indexer(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("QSAIndexer") and all(hasattr(module, a) for a in _ATTRS)


def select_tokens(
    indexer: torch.nn.Module,
    hidden_states: torch.Tensor,
    q: torch.Tensor,
    raw_keys: torch.Tensor,
    full_cos: torch.Tensor,
    full_sin: torch.Tensor,
    attention_mask: torch.Tensor,
    **kwargs,
) -> torch.Tensor:
    """``indexer._select_tokens`` (``[batch, 1, queries, keys]`` bool: the selected keys),
    computed without data-dependent shapes or branches."""
    rotary = sys.modules[type(indexer).__module__].apply_rotary_pos_emb
    ratio, topk = indexer.compress_ratio, indexer.block_topk
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    visible = visible[:, 0]  # [B, Q, K]
    batch, keys = visible.shape[0], visible.shape[-1]
    # a key's rank among the keys any query sees (the last one, under a causal mask)
    seen = visible.any(dim=1)  # [B, K]
    rank = seen.long().cumsum(-1) - 1  # [B, K]
    blocks = keys // ratio + 1  # ≥ ceil(K / ratio): room for a dump slot past every rank
    width = blocks * ratio
    slot = torch.where(seen, rank, width - 1)  # unseen keys: the last slot, never complete
    positions = torch.arange(keys, device=visible.device).expand(batch, keys)
    order = torch.zeros((batch, width), dtype=torch.long, device=visible.device)
    order = order.scatter(-1, slot, positions)  # [B, W]: the key at each rank
    dim = raw_keys.shape[-1]
    grouped = torch.gather(raw_keys, 1, order.unsqueeze(-1).expand(batch, width, dim))
    grouped = grouped.view(batch, blocks, ratio, dim)
    pooled = grouped.float().mean(dim=2).to(raw_keys.dtype)
    pooled = indexer.k_layernorm(pooled)  # [B, N, D]
    starts = order.view(batch, blocks, ratio)[..., 0]  # [B, N]
    rotary_dim = full_cos.shape[-1]
    at = starts.unsqueeze(-1).expand(batch, blocks, rotary_dim)
    cos, sin = torch.gather(full_cos, 1, at), torch.gather(full_sin, 1, at)
    block_keys = rotary(pooled.unsqueeze(2), cos=cos, sin=sin, unsqueeze_dim=2).squeeze(2)

    scores = torch.matmul(q.float(), block_keys.float().transpose(-1, -2).unsqueeze(1))
    scores = torch.relu(scores).sum(dim=2) / math.sqrt(indexer.index_head_dim)  # [B, Q, N]
    count = visible.sum(dim=-1, keepdim=True)  # [B, Q, 1]: keys each query sees
    complete = count // ratio  # blocks each query sees complete
    block = torch.arange(blocks, device=visible.device)
    scores = scores.masked_fill(block >= complete, float("-inf"))
    pad = scores.new_full((*scores.shape[:-1], topk), float("-inf"))
    picked = torch.cat([scores, pad], dim=-1).topk(topk, dim=-1).indices
    chosen = torch.zeros((*scores.shape[:-1], blocks + topk), dtype=torch.bool, device=q.device)
    chosen = chosen.scatter(-1, picked, True)[..., :blocks] & (block < complete)  # [B, Q, N]
    key_block = (rank.clamp(min=0) // ratio).unsqueeze(1).expand(-1, visible.shape[1], -1)
    in_chosen = torch.gather(chosen, -1, key_block)  # [B, Q, K]
    in_tail = rank.unsqueeze(1) >= complete * ratio
    return (visible & (in_chosen | in_tail)).unsqueeze(1)


@contextlib.contextmanager
def substituted(module: torch.nn.Module) -> Iterator[list[str]]:
    """Within the block, every block-sparse indexer of ``module`` selects its tokens with
    :func:`select_tokens`; yields their module paths."""

    def dense(_original):
        return select_tokens

    with instance_methods(module, "_select_tokens", _is_block_indexer, dense) as taken:
        if taken:
            logger.info("block-sparse indexers traced dense: %d", len(taken))
        yield [name for name, sub in module.named_modules() if any(sub is t for t in taken)]
