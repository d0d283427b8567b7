"""Gemma 3 and PaliGemma: a SigLIP vision tower and a projector (Gemma 3: pooled to
``mm_tokens_per_image`` soft tokens; PaliGemma: every patch), batched over images, and a
Gemma text model whose prompt attends bidirectionally where Hugging Face's does.

The bidirectional part is what makes these families more than a merge: with the processor's
``token_type_ids``, Hugging Face's prefill lets an image token of Gemma 3 see every token of
its own image block, later ones included (the causal mask OR'ed with a block mask). A mask
built from the token ids over the whole sequence would need the past's ids at every cached
step; instead each query gets a *reach*: the last key it may see is its own index plus
``extra`` (the image tokens after it in its block, 0 for any other token), so the mask is
``key ≤ query + extra`` with ``extra`` on the query axis only. The KV cache pass slices the
query side of the key/query indices to the new tokens as for any causal mask, and ``extra``
is computed from the new tokens alone: a decoding step's token is text (extra 0, causal, as
Hugging Face's cached steps drop ``token_type_ids``), and the image block lies within the
prompt, which is one chunk (the sliding window and the padding mask are applied as
transformers' masks apply them).

PaliGemma's whole prompt (image and text, ``token_type_ids`` 0) is bidirectional at prefill,
which the step's tokens cannot say: its decoder (:class:`PrefixDecoder`) takes each row's
prompt end, ``prompt_length`` (role ``prompt_length``), fed at every step by the runtime, and
the mask is ``key ≤ max(query, prompt_length − 1)``; its positions are 1-based, as its
``generate`` makes them. The export states both masks as ``bias_kind="prompt_block"``
(:mod:`tfgraph.passes.recognize.attention.prompt_block`): cached, lowered with the bias.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from tfgraph import contract
from tfgraph.sources.vlm_families.family import Family, Probe
from tfgraph.sources.vlm_graphs import merge_image_features


def _features(model: nn.Module, _probe: Probe):
    """The model's own ``get_image_features`` (tower and projector, batched: no loop)."""
    inner = model.model

    def features(pixel_values: torch.Tensor) -> torch.Tensor:
        pixels = pixel_values.to(inner.vision_tower.dtype)
        return inner.get_image_features(pixels, return_dict=True).pooler_output  # (B, N, H)

    return features


def image_reach(input_ids: torch.Tensor, image_token: int, index: torch.Tensor) -> torch.Tensor:
    """(B, T): for an image token, how many image tokens follow it up to the row's last one;
    0 for every other token. One image block per row, as the block merge reads it: no count
    over the sequence (a CumSum of the ids, which the KV cache pass refuses), the last image
    token an ArgMax of the flipped row. ``index``: the tokens' indices; in a cached step they
    continue past the cache while the last image token is counted in the step's own tokens,
    so the difference is clamped at 0 (a generated image token attends causally, as Hugging
    Face's cached steps, without ``token_type_ids``, do)."""
    is_image = input_ids == image_token
    last = input_ids.shape[1] - 1 - is_image.flip(-1).float().argmax(-1, keepdim=True)  # (B, 1)
    reach = (last - index[None, :]).clamp(min=0)
    return torch.where(is_image, reach, 0)


def bidirectional_masks(model: nn.Module, image_token: int):
    """The decoder's attention masks (``attention_mask`` argument of the model's forward): a
    dict of boolean (B, 1, T, T) masks by layer type, each ``key ≤ query + reach`` and the
    padding mask (the sliding layers' also ``key > query − window``), as transformers' masks
    with ``token_type_ids`` (``create_masks_for_vision_model``) are at the prompt."""
    text = model.config.get_text_config()
    window = getattr(text, "sliding_window", None)
    types = set(getattr(text, "layer_types", None) or ["full_attention"])

    def masks(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        index = torch.arange(input_ids.shape[1], device=input_ids.device)
        extra = image_reach(input_ids, image_token, index)
        reach = index[None, :, None] + extra[..., None]  # (B, T, 1)
        keys = index[None, None, :]  # (1, 1, T)
        full = (keys <= reach) & attention_mask[:, None, :].bool()  # (B, T, T)
        out = {"full_attention": full[:, None]}
        if "sliding_attention" in types:
            near = keys > index[None, :, None] - window if window else True
            out["sliding_attention"] = (full & near)[:, None]
        return {t: out[t] for t in types}

    return masks


GEMMA3 = Family(_features, attention=bidirectional_masks)

# The export keeps this mask: the attention classifier probes it with the image token (the id
# the graph compares input_ids against) and states it as bias_kind "prompt_block", non-causal
# with the bias kept; the KV cache pass caches it as a kept causal bias and the lowering runs
# it with the bias (passes/recognize/attention/prompt_block.py).


# PaliGemma: the whole prompt (image, text) attends bidirectionally at prefill (the processor's
# token_type_ids are 0 over it); generated tokens are causal. The step's tokens cannot say
# where the prompt ended, so the decoder takes it: ``prompt_length``, (batch, 1), each row's
# prompt end in the step's columns (left padding included), fed at every step.
PROMPT_LENGTH = "prompt_length"
# the parity inputs' prompt length: within the cache parity's 5-token prompt, so that its
# eager pass over prompt + steps and the cached steps see the same prefix
PARITY_PROMPT_LENGTH = 3


def prefix_masks(model: nn.Module):
    """The text model's attention masks as a function of (``attention_mask``, ``input_ids``,
    ``prompt_length``): ``key ≤ max(query, prompt_length − 1)`` and the padding mask (the
    sliding layers' also ``key > query − window``): every prompt token sees the whole prompt,
    a later token the keys up to itself, as Hugging Face's mask with ``token_type_ids``. The
    reach is on the query axis (as :func:`bidirectional_masks`'), a dict by layer type where
    the text model has several, else one (B, 1, T, T) mask."""
    text = model.config.get_text_config()
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)

    def masks(input_ids, attention_mask, prompt_length):
        index = torch.arange(input_ids.shape[1], device=input_ids.device)
        extra = (prompt_length - 1 - index[None, :]).clamp(min=0)  # (B, T)
        reach = index[None, :, None] + extra[..., None]  # (B, T, 1)
        keys = index[None, None, :]
        full = (keys <= reach) & attention_mask[:, None, :].bool()
        if not types:
            return full[:, None]
        out = {"full_attention": full[:, None]}
        if "sliding_attention" in types:
            near = keys > index[None, :, None] - window if window else True
            out["sliding_attention"] = (full & near)[:, None]
        return {t: out[t] for t in set(types)}

    return masks


class PrefixDecoder(nn.Module):
    """PaliGemma's decoder graph: ``input_ids``, ``attention_mask``, ``image_features``,
    ``prompt_length`` → ``logits``: the block merge, the prefix mask (:func:`prefix_masks`),
    positions 1-based (Hugging Face's ``prepare_inputs_for_generation`` adds 1 to the
    padding mask's). ``row_inputs``: ``prompt_length`` and its parity example (the runtime
    computes it: the longest prompt, as ``generate`` pads every row to it on the left)."""

    def __init__(self, model: nn.Module, image_token: int, _probe: Probe) -> None:
        super().__init__()
        self.model, self.image_token = model, image_token
        self.vocab = model.get_input_embeddings().num_embeddings
        self.masks = prefix_masks(model)
        width = model.get_input_embeddings().embedding_dim
        self.register_buffer("zero_row", torch.zeros(1, 1, width), persistent=False)
        example = torch.tensor([[PARITY_PROMPT_LENGTH]])
        self.row_inputs = {PROMPT_LENGTH: (PROMPT_LENGTH, example)}
        self.input_roles = {
            "image_features": contract.IMAGE_FEATURES,
            PROMPT_LENGTH: contract.PROMPT_LENGTH,
        }

    def forward(self, input_ids, attention_mask, image_features, prompt_length) -> torch.Tensor:
        # an image token outside the vocabulary embeds as token 0 (Hugging Face's forward)
        ids = input_ids
        if self.image_token >= self.vocab:
            ids = torch.where(input_ids == self.image_token, 0, input_ids)
        embeds = self.model.get_input_embeddings()(ids)
        embeds = merge_image_features(
            embeds, input_ids, image_features, self.image_token, self.zero_row
        )
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        out = self.model.model.language_model(
            inputs_embeds=embeds,
            attention_mask=self.masks(input_ids, attention_mask, prompt_length),
            position_ids=positions + 1,
            use_cache=False,
        )
        return self.model.lm_head(out.last_hidden_state)


@dataclasses.dataclass(frozen=True)
class PrefixFamily(Family):
    """A family with its own decoder module (``decoder(model, image_token, probe)``)."""

    decoder: Callable[[nn.Module, int, Probe], nn.Module] | None = None


PALIGEMMA = PrefixFamily(_features, decoder=PrefixDecoder)
FAMILIES: dict[str, Family] = {"gemma3": GEMMA3, "paligemma": PALIGEMMA}
