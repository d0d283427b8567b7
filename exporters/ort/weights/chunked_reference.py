"""The quantized reference's huge head or embedding table computed from the artifact's bytes
in pieces (:mod:`tfgraph.sources.in_pieces`: a 250k-word vocabulary is 4.1 GB in fp32 for
each): a block of head rows dequantized from its ``MatMulNBits`` just before it is used, the
embedding's rows of the tokens asked read from its ``GatherBlockQuantized``'s stored bytes."""

from __future__ import annotations

import torch
from torch import nn

from tfgraph.exporters.ort.weights.dequantize import dequantize_rows
from tfgraph.exporters.ort.weights.gather_nbits import dequantize_table
from tfgraph.sources.in_pieces import ChunkedHead, RowEmbedding, huge, replace


def swap_large(model: nn.Module, by_param: dict[str, dict], nodes: dict, initializers) -> list:
    """Put :class:`ChunkedHead` / :class:`RowEmbedding` reading the artifact's bytes in place
    of each module whose quantized weight (``by_param``: parameter name → its placement) is
    :func:`huge`; the parameter names now computed in pieces."""
    swapped = []
    for name, entry in by_param.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if attr != "weight" or not huge(owner):
            continue
        node, shape = nodes[entry["node"]], owner.weight.shape
        if entry.get("embedding") and type(owner) is nn.Embedding:
            new = RowEmbedding(_table_reader(node, initializers), shape)
        elif type(owner) is nn.Linear and entry["transposed"]:
            c0 = entry["columns"][0]
            new = ChunkedHead(
                lambda r0, r1, n=node, c=c0: dequantize_rows(n, initializers, (c + r0, c + r1)),
                shape,
            )
        else:
            continue
        replace(model, owner_name, new)
        swapped.append(name)
    return swapped


def _table_reader(node, initializers):
    def rows_at(ids):
        return torch.from_numpy(dequantize_table(node, initializers, ids))

    return rows_at
