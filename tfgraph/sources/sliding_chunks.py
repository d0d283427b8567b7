"""Longformer's sliding-chunk attention (Longformer, LED's encoder) traced dense, banded.

Hugging Face's ``LongformerSelfAttention`` (and LED's copy, ``LEDEncoderSelfAttention``)
computes each query's scores against the ``w`` keys on either side of it (``w`` =
``attention_window // 2``) in overlapping chunks of ``2w`` tokens: ``view`` s sized by
``seq_len // (2w)``, ``as_strided`` overlaps, pads and diagonal reshuffles, on a sequence the
model's forward first pads to a multiple of ``attention_window`` (``_pad_to_window_size``).
torch.export cannot trace those views on a dynamic length (the ``view`` of ``_chunk`` guards on
the length: "the model branches on tensor values"), and the result would be no attention core
the passes know.

While tracing, each such layer's ``forward`` is this module's dense equivalent, with the same
result when no token has global attention: ``softmax(q·kᵀ/√d + bias)·v`` over the whole
sequence, the bias ``0`` where ``|i − j| ≤ w`` and the key is visible (the layer's
``attention_mask`` is 0 there) and the dtype's lowest value elsewhere. That is what the chunks
compute:

- within the band, a visible key's score is the same ``q·k``; a masked key gets the lowest value
  added, as Hugging Face adds its ``float_mask``;
- outside the band Hugging Face has no entry at all (``-inf`` where the window reaches past
  either end of the sequence); here the lowest value, whose ``exp`` underflows to exactly 0 next
  to any visible score (every unmasked query sees itself);
- a masked query's row (``is_index_masked``: padding) is all zeros in Hugging Face
  (``masked_fill`` of its probabilities): the output row is zeroed here, after the attention.

The dense form needs no padding to a multiple of the window, so the model's
``_pad_to_window_size`` pads nothing while tracing (``padding_len`` 0). Eager pads with keys that
are masked (they add exact zeros to every real query's softmax) and slices the padded rows off
again, so the real rows are the same; and the traced graph then holds no length-dependent
branch (LED's ``hidden_states[:, :-padding_len]``, traced with ``padding_len`` > 0, would be
empty at lengths that are multiples of the window).

The dense form is one ordinary attention core, which the attention rules fuse into
``tfgraph.Attention``, the band-and-padding bias its bias input (symmetric, not causal: it is
kept, ``bias_kind`` ``padding`` with an ``attention_mask`` input, ``additive`` without). Its
cost is dense: ``n²`` scores per head (and bias entries per batch row) for ``n`` tokens, where
the chunks compute about ``4n'·w`` (``n'/w − 1`` chunks of ``2w × 2w``, on ``n'`` ≥ ``n``, the
next multiple of ``2w``): less for ``n`` up to about ``4w``, ``n/(4w)`` times more beyond (a
4096-token Longformer-base input, ``w`` = 256: 4× the scores, and a 4096² bias per batch row).
A kernel with a symmetric window would bring it back to ``O(n·w)``.

Global attention (``global_attention_mask``, or ``attention_mask`` values of 2) reads the
positions of the global tokens (``nonzero``: data-dependent shapes): when the traced model has a
``global_attention_mask`` input nothing is substituted, and the trace fails as before; a graph
traced without it has no global attention. With ``output_attentions`` (the per-window
probabilities) or a concrete global token in eager, the original runs. Eager PyTorch (the parity
reference) runs the original.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

_ATTRS = (
    "one_sided_attn_window_size",
    "_sliding_chunks_query_key_matmul",
    "_sliding_chunks_matmul_attn_probs_value",
    "query",
    "key",
    "value",
    "num_heads",
    "head_dim",
)
GLOBAL_INPUT = "global_attention_mask"


def _is_sliding_chunks(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in _ATTRS)


def band_bias(attention_mask: torch.Tensor, window: int, dtype: torch.dtype) -> torch.Tensor:
    """``[batch, 1, n, n]``: 0 where key ``j`` is within ``window`` of query ``i`` and visible
    (the layer's ``attention_mask`` is 0 there), the dtype's lowest value elsewhere."""
    length = attention_mask.shape[-1]
    position = torch.arange(length, device=attention_mask.device)
    band = (position[:, None] - position[None, :]).abs() <= window  # [n, n]
    visible = (attention_mask == 0)[:, None, None, :]  # [B, 1, 1, n]
    keep = band[None, None] & visible
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    return torch.where(keep, zero, torch.finfo(dtype).min)


def dense_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    is_index_masked: torch.Tensor | None = None,
    is_index_global_attn: torch.Tensor | None = None,
    is_global_attn=None,
    output_attentions: bool = False,
):
    """``self.forward`` (a sliding-chunk self-attention's) as dense banded attention, for
    inputs without global attention: ``(output,)``, ``output`` ``[batch, n, embed]``."""
    if output_attentions or is_global_attn is True:  # a concrete True: eager, global tokens
        return type(self).forward(
            self,
            hidden_states,
            attention_mask=attention_mask,
            is_index_masked=is_index_masked,
            is_index_global_attn=is_index_global_attn,
            is_global_attn=is_global_attn,
            output_attentions=output_attentions,
        )
    batch, length, embed = hidden_states.shape
    heads, dim = self.num_heads, self.head_dim

    def split(x):  # [B, n, E] → [B, H, n, D]
        return x.view(batch, length, heads, dim).transpose(1, 2)

    query = split(self.query(hidden_states) / math.sqrt(dim))
    key, value = split(self.key(hidden_states)), split(self.value(hidden_states))
    scores = torch.matmul(query, key.transpose(-1, -2))
    scores = scores + band_bias(attention_mask, self.one_sided_attn_window_size, scores.dtype)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(scores)
    probs = torch.nn.functional.dropout(probs, p=self.dropout, training=self.training)
    output = torch.matmul(probs, value).transpose(1, 2).reshape(batch, length, embed)
    keep = (~is_index_masked)[:, :, None].to(output.dtype)  # masked queries: zero rows
    return (output * keep,)


def _unpadded(function):
    """A model's ``_pad_to_window_size`` (bound) that pads nothing: ``(0, *its inputs)``, in
    the order it takes them (its ``pad_token_id`` left out), as Longformer's and LED's return
    them; ``None`` for another signature. In eager, with global tokens (mask values above 1,
    for which the original attention runs), it pads as before."""
    names = [n for n in inspect.signature(function).parameters if n != "pad_token_id"]
    if names not in _PADDED_INPUTS:
        return None

    def unpadded(*args, **kwargs):
        bound = dict(zip(names, args, strict=False)) | kwargs
        mask = bound.get("attention_mask")
        if mask is not None and not torch.compiler.is_compiling() and bool((mask > 1).any()):
            return function(*args, **kwargs)
        return (0, *(bound.get(n) for n in names))

    return unpadded


_PADDED_INPUTS = (  # Longformer's, LED's
    ["input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds"],
    ["input_ids", "attention_mask", "inputs_embeds"],
)


@contextlib.contextmanager
def substituted(module: torch.nn.Module, inputs: Iterable[str] = ()) -> Iterator[list[str]]:
    """Within the block, every sliding-chunk self-attention of ``module`` runs
    :func:`dense_forward` and the modules that pad for them pad nothing, unless ``inputs``
    (the traced input names) has ``global_attention_mask``; yields the attentions' paths."""
    found = [(name, sub) for name, sub in module.named_modules() if _is_sliding_chunks(sub)]
    if found and GLOBAL_INPUT in set(inputs):
        logger.info("sliding-chunk attention left as is: the model is traced with %s", GLOBAL_INPUT)
        found = []
    patched: list[tuple[torch.nn.Module, str]] = []
    for _, sub in found:
        sub.forward = dense_forward.__get__(sub)
        patched.append((sub, "forward"))
    for sub in module.modules() if found else ():
        pad = getattr(sub, "_pad_to_window_size", None)
        unpadded = _unpadded(pad) if pad is not None else None
        if unpadded is not None:
            sub._pad_to_window_size = unpadded
            patched.append((sub, "_pad_to_window_size"))
    if found:
        logger.info("sliding-chunk attention traced dense (banded): %d layers", len(found))
    try:
        yield [name for name, _ in found]
    finally:
        for sub, attr in patched:
            delattr(sub, attr)
