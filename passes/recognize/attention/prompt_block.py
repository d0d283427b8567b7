"""A mask that is causal except where the step's own token ids open a block: ``prompt_block``.

Gemma 3's prefill lets an image token see every token of its own image block, later ones
included (Hugging Face's mask with ``token_type_ids``); PaliGemma's whole prompt prefix is
bidirectional. Such a mask is a function of the token ids, and evaluated with the ids 0 and 1
(:mod:`.classify_bias`) it looks plainly causal with key padding: only the ids the graph
compares the tokens against (``input_ids == image_token``: the constants of ``Equal`` nodes fed
by a token-id input) show it, or, for a graph told where the prompt ends (PaliGemma's
``prompt_length`` input, role :data:`tfgraph.contract.PROMPT_LENGTH`), a prompt as long as the
probe. This module finds those ids and judges the evaluated biases:

- with ordinary ids, the bias masks every later key (causal, with any window and padding);
- with one of the compared ids, it masks a subset of that, and every key it opens lies after
  its query: the block is bidirectional, everything else is as before.

Then the layer is ``bias_kind="prompt_block"``, ``causal=0``, the bias kept whole (the causal
part, the window and the padding are in it). The KV cache pass caches it as a kept causal bias
(its query side is computed from the step's tokens only, so a decoding step, text, is causal);
the lowering runs it with the bias, never a kernel's own causal mask.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tfgraph.contract import TOKEN_IDS, names_with_role
from tfgraph.passes.rewrite_utils import constant

PROMPT_BLOCK = "prompt_block"
MASKED = -1e8
_THROUGH = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"}
MAX_IDS = 8  # compared ids probed; a graph comparing its tokens to more is not a block mask


def compared_ids(model: ir.Model) -> list[int]:
    """The integer constants that ``Equal`` nodes compare a token-id input against (through
    casts and views), besides 0 and 1 (already probed), in graph order."""
    ids = set(names_with_role(model, TOKEN_IDS))
    found: list[int] = []
    for node in model.graph:
        if node.op_type != "Equal" or node.domain not in ("", "ai.onnx"):
            continue
        for data, other in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
            value = constant(other)
            if value is None or value.size != 1 or not _from_ids(data, ids):
                continue
            token = int(value.reshape(-1)[0])
            if token == float(value.reshape(-1)[0]) and token not in (0, 1, *found):
                found.append(token)
    return found[:MAX_IDS]


def _from_ids(value: ir.Value | None, ids: set[str]) -> bool:
    while value is not None:
        if value.is_graph_input():
            return value.name in ids
        node = value.producer()
        if node is None or node.op_type not in _THROUGH or node.domain not in ("", "ai.onnx"):
            return False
        value = node.inputs[0]
    return False


def opens_later_keys(plain, special) -> bool:
    """Whether ``special`` (the bias with a compared id) differs from ``plain`` (ordinary ids)
    only by keys after their query it no longer masks, and ``plain`` masks every later key."""
    a, b = np.asarray(plain), np.asarray(special)
    if a.shape != b.shape or a.ndim < 2 or a.shape[-1] != a.shape[-2] or a.shape[-1] < 2:
        return False
    later = np.triu(np.ones(a.shape[-2:], bool), k=1)
    masked_a, masked_b = a <= MASKED, b <= MASKED
    if not masked_a[..., later].all() or (masked_b & ~masked_a).any():
        return False
    opened = masked_a & ~masked_b
    if not opened.any() or (opened & ~later).any():
        return False
    same = ~opened  # everywhere else the two biases are the same
    return bool(np.array_equal(np.where(same, a, 0), np.where(same, b, 0)))


ATTRIBUTES = {"causal": 0, "window": 0, "keep": True, "bias_kind": PROMPT_BLOCK}


def classify_prompt_block(plain: list, special: list) -> dict | None:
    """``prompt_block`` attributes when at every evaluated size some compared id opens later
    keys (:func:`opens_later_keys`), else None. ``plain``: the bias evaluated with ordinary
    ids, one per size; ``special``: per compared id, the evaluations at the same sizes."""
    for runs in special:
        if all(
            s is not None and p is not None and opens_later_keys(p, s)
            for p, s in zip(plain, runs, strict=True)
        ):
            return dict(ATTRIBUTES)
    return None
