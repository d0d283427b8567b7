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
"""

from __future__ import annotations

import torch
from torch import nn

from tfgraph.sources.vlm_families.family import Family, Probe


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
FAMILIES: dict[str, Family] = {"gemma3": GEMMA3}
