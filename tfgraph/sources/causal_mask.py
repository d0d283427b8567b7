"""``F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=True)`` traced as one
mask: the bias with the causal positions masked, ``is_causal=False``.

PyTorch's CPU flash kernel, which eager inference takes (:mod:`tfgraph.sources.inference_trace`),
takes both and applies both: the mask, and the causal mask aligned to the top left (query ``i``
sees keys ``j ≤ i``). Its math back-end refuses the pair ("Explicit attn_mask should not be set
when is_causal=True"), and so does the ONNX translation of the op (onnxscript's
``aten_scaled_dot_product_attention``: "is_causal and attn_mask cannot be set at the same
time"). While tracing, such a call is made with the causal mask folded into ``attn_mask``: a
float mask gets ``-inf`` above the diagonal, a boolean one is and-ed with the lower triangle.
That is what the flash kernel computes (tests/sources/test_relative_bias_mask.py compares them).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}


def folded(attn_mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``attn_mask`` with the top-left causal mask of ``query`` × ``key`` folded in."""
    rows, cols = query.shape[-2], key.shape[-2]
    causal = torch.ones(rows, cols, dtype=torch.bool, device=query.device).tril()
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    return attn_mask.masked_fill(~causal, float("-inf"))


class CausalMaskFolded(TorchFunctionMode):
    """Within the mode, SDPA calls with an ``attn_mask`` and ``is_causal=True`` get the causal
    mask folded into ``attn_mask`` (see the module docstring); ``count``: how many."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _SDPA:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
            bound = {**dict(zip(names, args, strict=False)), **kwargs}
            if bound.get("attn_mask") is not None and bound.get("is_causal"):
                self.count += 1
                bound["attn_mask"] = folded(bound["attn_mask"], bound["query"], bound["key"])
                bound["is_causal"] = False
                return func(**bound)
        return func(*args, **kwargs)
