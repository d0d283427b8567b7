"""Cache a per-token value that an attention bias reads along the key axis, like K.

DeepSeek's sparse attention (DSA) picks each query's keys with an indexer: scores
``q_idx · k_idx`` over every key, ``TopK`` of them scattered into the mask. Its keys ``k_idx``
are computed per token, like the attention's K, so a cached step needs them for the past
tokens too; Hugging Face keeps them beside the KV cache (``cache.update_indexer``). The KV
cache pass (:mod:`.insert_kv_cache`) finds such a value walking back from the bias (a token
value whose only sequence axes become the key axis); :func:`cache_token_value` gives it:

- an input ``past_token_values.{i}`` (role ``past_token_values``): (batch, 1, past, width),
  the value's other axes flattened into ``width``; empty (past 0) before the first step;
- an output ``present_token_values.{i}`` (``present_token_values``): the past followed by the
  new tokens' rows, (batch, 1, total, width), fed back as the next step's past;
- the readers it was found at read the present, back in the value's own layout::

    value (B, …, T, …) ─Transpose─Reshape─Unsqueeze─▶ (B, 1, T, W)
    Concat(past (B, 1, P, W), ·, axis=2) = present (B, 1, L, W)
    present ─Squeeze─Reshape─Transpose─▶ (B, …, L, …) → the readers
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tfgraph import contract
from tfgraph.passes.rewrite_utils import dims_of


def cache_token_value(
    model: ir.Model, value: ir.Value, readers: list[tuple[ir.Node, int]], seq: str, index: int
) -> None:
    """Grow ``value`` (token rows along symbol ``seq``) by its past rows for ``readers``.
    Raises ``ValueError`` for a value without a leading batch axis or with symbolic width."""
    dims = dims_of(value)
    axis = dims.index(seq)
    others = [i for i in range(len(dims)) if i not in (0, axis)]
    if axis == 0 or not all(isinstance(dims[i], int) for i in others):
        raise ValueError(
            f"'{value.name}' {list(map(str, dims))} is read along the key axis, but only a "
            "(batch, …, sequence, …) value with static other dims can be cached"
        )
    width = int(np.prod([dims[i] for i in others], dtype=np.int64))
    nodes: list[ir.Node] = []

    def add(op: str, inputs: list, **attributes) -> ir.Value:
        node = ir.node(op, inputs, attributes)
        node.metadata_props.update(value.producer().metadata_props)
        nodes.append(node)
        return node.outputs[0]

    def const(values: list[int]) -> ir.Value:
        return add("Constant", [], value=ir.tensor(np.array(values, np.int64)))

    perm = [0, axis, *others]
    rows = add("Transpose", [value], perm=perm) if perm != list(range(len(dims))) else value
    rows = add("Unsqueeze", [add("Reshape", [rows, const([0, 0, width])]), const([1])])
    batch = dims[0]
    past = ir.Value(
        name=contract.tensor_name(contract.PAST_TOKENS, index),
        type=value.type,
        shape=ir.Shape([batch, 1, contract.PAST_DIM, width]),
    )
    model.graph.inputs.append(past)
    contract.set_role(model, past.name, contract.PAST_TOKENS, index)
    present = add("Concat", [past, rows], axis=2)
    present.name, present.type = contract.tensor_name(contract.PRESENT_TOKENS, index), value.type
    present.shape = ir.Shape([batch, 1, contract.TOTAL_DIM, width])
    contract.set_role(model, present.name, contract.PRESENT_TOKENS, index)
    model.graph.outputs.append(present)
    full = add("Squeeze", [present, const([1])])
    full = add("Reshape", [full, const([0, 0, *[dims[i] for i in others]])])
    if perm != list(range(len(dims))):
        full = add("Transpose", [full], perm=[perm.index(i) for i in range(len(dims))])
    full.type = value.type
    full.shape = ir.Shape([contract.TOTAL_DIM if i == axis else d for i, d in enumerate(dims)])
    model.graph.insert_after(value.producer(), nodes)
    for node, slot in readers:
        node.replace_input_with(slot, full)
