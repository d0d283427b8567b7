"""Find the mask inside a bias computed from the tokens.

A bias computed from activations cannot be evaluated on its own (it reads a fused op's
output), but it often applies a mask computed from shapes and ``attention_mask`` alone, which
can. DeepSeek's sparse-attention indexer (DSA) and Doge's dynamic mask build their bias as::

    keep  = And(causal_keep, Not(ScatterElements(ones, TopK(index_scores).indices, False)))
    bias  = Where(keep, 0, -inf)                  # a boolean keep-mask turned additive
    bias  = Where(selected, -big, causal_bias)    # or: masked_fill of an additive mask

Every entry that ``causal_keep`` (or ``causal_bias``) masks stays masked in ``bias``, whatever
the token part computes; :func:`mask_candidates` lists such parts for the classifier
(:mod:`.classify_attention_bias`) to evaluate. Cases, for a value ``b``:

1. ``Where(c, 0, m)`` with ``m`` ≤ −1e8: every conjunct of ``c`` (through ``And``) is a
   boolean keep-mask candidate (``keep``: True where a key is visible);
2. ``Where(c, m, x)`` with ``m`` ≤ −1e8 (a masked fill, Doge's): ``c`` (``fill``: True where
   masked), ``x`` and the candidates of ``x``;
3. ``Add(x, y)``: ``x``, ``y`` and their candidates (a finite term cannot unmask an entry
   at −1e8 or below);
4. ``Reshape``, ``Expand``, ``Unsqueeze``, ``Squeeze``, ``Cast``, ``Identity`` of a bias
   (``repeat_kv`` of a per-KV-head mask): the candidates of what they view.

Masking more than the causal mask keeps a layer causal in its mask; that each query row reads
only tokens up to its own is what the KV cache's parity check (cached against uncached)
proves for the exported artifact.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

MASKED = -1e8
_STANDARD = ("", "ai.onnx")


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is not None and node.op_type == "Constant" and "value" in node.attributes:
        return node.attributes["value"].as_tensor().numpy()
    return None


def _all(value: ir.Value, test) -> bool:
    array = _const(value)
    return array is not None and array.size > 0 and bool(test(np.asarray(array, np.float64)))


def _conjuncts(value: ir.Value) -> list[ir.Value]:
    node = value.producer()
    if node is not None and node.domain in _STANDARD and node.op_type == "And":
        return [c for i in node.inputs for c in _conjuncts(i)]
    return [value]


_VIEWS = {"Reshape", "Expand", "Unsqueeze", "Squeeze", "Cast", "Identity"}


def mask_candidates(value: ir.Value, depth: int = 6) -> list[tuple[ir.Value, str]]:
    """Parts of bias ``value`` whose masked entries stay masked in it: ``(part, kind)``, kind
    ``keep`` (a boolean, True where a key is visible), ``fill`` (a boolean, True where
    masked) or ``bias`` (additive)."""
    node = value.producer()
    if node is None or node.domain not in _STANDARD or depth == 0:
        return []
    found: list[tuple[ir.Value, str]] = []
    if node.op_type in _VIEWS:
        found += mask_candidates(node.inputs[0], depth - 1)
    elif node.op_type == "Where":
        cond, yes, no = node.inputs
        if _all(yes, lambda a: (a == 0).all()) and _all(no, lambda a: (a <= MASKED).all()):
            found += [(c, "keep") for c in _conjuncts(cond)]
        elif _all(yes, lambda a: (a <= MASKED).all()):
            found += [(cond, "fill"), (no, "bias"), *mask_candidates(no, depth - 1)]
    elif node.op_type == "Add":
        for term in node.inputs:
            found += [(term, "bias"), *mask_candidates(term, depth - 1)]
    return found
