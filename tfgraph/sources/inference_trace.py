"""Tracing with autograd off: the graph of the function that inference (and parity) runs.

A model that passes a bias computed from its parameters as SDPA's ``attn_mask`` (a T5-style
bucketed relative position bias: ``embedding(buckets).permute(2, 0, 1)[None]``) and reshapes
the attention's output with ``out.transpose(1, 2).view(B, L, H * D)`` runs under
``torch.no_grad()`` but not with autograd on, in eager PyTorch as in torch.export:

- PyTorch's CPU attention picks its back-end per call. Its flash kernel takes no mask that
  requires grad, so a mask made from an ``nn.Embedding``'s weight sends the call to the math
  back-end when autograd is on, and to the flash kernel under ``no_grad``.
- The two give the same values in different memory layouts: the flash kernel writes
  ``(B, L, H, D)`` and returns it transposed to ``(B, H, L, D)``; the math back-end returns a
  contiguous ``(B, H, L, D)``. ``.transpose(1, 2).view(B, L, H * D)`` is valid on the first
  only, and fails on the second with "Cannot view a tensor with shape [B, L, H, D] … as
  (B, L, H*D)".
- torch.export traces with the parameters requiring grad and autograd on (the model's
  training function): the fake SDPA takes the math back-end's layout and the ``view`` fails,
  whatever the batch (a fixed batch fails the same way). Eager inference, and tfgraph's parity
  reference (:meth:`tfgraph.sources.model.ModelSource.eager`), run under ``no_grad``.

So the trace of a module (an ``nn.Module``, a factory's, a zoo preset) runs under
:func:`torch.no_grad` too: it captures the function parity compares against. The exported ops
are the same (``aten.scaled_dot_product_attention`` is one op either way; only the fake
tensors' layouts, which the graph does not carry, differ). The flash kernel also takes
``attn_mask`` with ``is_causal=True``, which the ONNX translation does not: such calls are
traced with one mask (:mod:`tfgraph.sources.causal_mask`).

A Hugging Face model (a source with a ``model_type``) is traced as before, with autograd on:
an attention back-end of its that does not trace is retried with eager attention
(:mod:`tfgraph.sources.tracing`), and its graphs are pinned by ``tests/test_same_graphs.py``.
Traced for inference, T5 with ``sdpa`` (the same bias from an embedding) traces without that
retry, into another graph than its two pinned ones (``tiny:t5|ort``, ``tiny:t5|ort|kv``):
that change is left to a decision on the pinned graphs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from tfgraph.sources.causal_mask import CausalMaskFolded
from tfgraph.sources.model import ModelSource

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def for_inference(source: ModelSource | None = None) -> Iterator[None]:
    """Autograd off within the block (see the module docstring): the trace sees the layouts
    that eager inference produces; SDPA's causal flag folded into its mask when it has both.
    A Hugging Face ``source`` is left as it is."""
    if source is not None and "model_type" in source.info:
        yield
        return
    with torch.no_grad(), CausalMaskFolded() as folding:
        yield
    if folding.count:
        logger.info("attention with a mask and is_causal traced as one mask: %d", folding.count)
