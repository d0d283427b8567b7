"""A streamed model's largest weights, never loaded whole.

A 250k-word vocabulary at width 4096 (BLOOM-7B1) is 4.1 GB in fp32 for its embedding table
and as much for its head: the streamed reference dequantizing either whole beside the
session's 5 GB put a 7B int4 export past 12 GiB. Past :data:`LARGE` elements:

- a **head** (``nn.Linear`` without bias) becomes :class:`ChunkedHead`: the logits
  :data:`ROWS` output columns at a time, each block of weight rows read just before it is
  used (the same values, the same fp32 products per column: only the columns are computed
  apart);
- an **embedding** (``nn.Embedding``) becomes :class:`RowEmbedding`: the rows of the tokens
  asked for.

The rows come from the checkpoint for the fp32 streamed model (:func:`in_pieces`), from the
artifact's bytes for the quantized reference
(:mod:`tfgraph.exporters.ort.weights.chunked_reference`).
Each takes its module's place after the streamed model is built (its offload hook goes with
the old module); activation quantization hooks are registered on the new one.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

LARGE = 1 << 28  # elements (1 GiB in fp32): past this a weight is computed with in pieces
ROWS = 8192  # output columns of a head dequantized at a time


class ChunkedHead(nn.Module):
    """``x @ Wᵀ`` for a head whose (N, K) weight ``rows(r0, r1)`` reads a block of rows of."""

    def __init__(self, rows, shape) -> None:
        super().__init__()
        self.rows = rows
        self.weight = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.weight.shape[0]
        out = x.new_empty(*x.shape[:-1], n)
        for r0 in range(0, n, ROWS):
            r1 = min(r0 + ROWS, n)
            out[..., r0:r1] = nn.functional.linear(x, self.rows(r0, r1))
        return out


class RowEmbedding(nn.Module):
    """``table[ids]`` for a table whose rows ``rows_at(ids)`` reads: only the rows asked."""

    def __init__(self, rows_at, shape) -> None:
        super().__init__()
        self.rows_at = rows_at
        self.weight = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        return self.rows_at(unique.numpy())[inverse].reshape(*ids.shape, -1)


def huge(owner: nn.Module) -> bool:
    """An embedding or a bias-free Linear whose weight has more than :data:`LARGE` elements."""
    weight = owner._parameters.get("weight")
    if weight is None or weight.numel() <= LARGE:
        return False
    return type(owner) is nn.Embedding or (type(owner) is nn.Linear and owner.bias is None)


def replace(model: nn.Module, owner_name: str, new: nn.Module) -> None:
    parent, _, child = owner_name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)
    logger.info("streamed reference: %s computed in pieces", owner_name)


def in_pieces(model: nn.Module, keys: dict, checkpoint, overrides) -> None:
    """A huge embedding or head (a 250k-word vocabulary: 4.1 GB in fp32) computed from the
    checkpoint's rows in pieces, never loaded whole (the quantized reference's own come from
    the artifact: :mod:`tfgraph.exporters.ort.weights.chunked_reference`)."""
    for owner_name, owner in list(model.named_modules()):
        name = f"{owner_name}.weight"
        if not huge(owner) or name not in keys or (overrides is not None and name in overrides):
            continue
        key, shape = keys[name], owner.weight.shape

        def rows(index, key=key):
            return checkpoint.rows(key, index, torch.float32)

        if type(owner) is nn.Embedding:
            new = RowEmbedding(lambda ids, rows=rows: rows(torch.from_numpy(ids)), shape)
        else:
            new = ChunkedHead(lambda r0, r1, rows=rows: rows(slice(r0, r1)), shape)
        replace(model, owner_name, new)
