"""Mllama (Llama 3.2 Vision): the text model reads the image through cross-attention layers,
not through image tokens merged into its embeddings.

- **vision graph**: ``pixel_values`` (images, 1, tiles, C, H, W), ``aspect_ratio_ids`` and
  ``aspect_ratio_mask`` → ``image_features`` (images, tiles × patches, hidden): the model's own
  vision model and projector, Hugging Face's ``cross_attention_states`` laid out one row per
  image. The processor pads every image to ``max_num_tiles`` tiles, so the shapes do not
  follow the image's size (``aspect_ratio_mask`` says which tiles are real).
- **decoder**: ``input_ids``, ``attention_mask``, ``image_features`` and ``image_tiles`` (the
  row's ``aspect_ratio_mask``, (batch, tiles)) → ``logits`` (:class:`CrossAttentionDecoder`).
  The image tokens' features are keys and values of the cross-attention layers, so the KV
  cache pass names their keys and values cross K/V and the export splits them off as the
  decoder's *encoder* (:mod:`tfgraph.passes.cache.split_encoder`, as for T5 or Whisper): the
  runtime runs it once per prompt on the vision graph's features and binds its keys and values
  at every step; a step runs the cross-attention's query side only.

Hugging Face's per-token ``cross_attention_mask`` (which image tiles a text token attends:
those of the image at or before it, none before the image) is computed in the graph from the
ids and ``image_tiles``, with the model's own ``_prepare_cross_attention_mask``: "at or after
the image token" is a cumulative count of the image token, which the KV cache pass continues
past the cache (a generated token comes after the prompt's image, as the last row Hugging
Face's ``generate`` repeats for it says). One image per prompt: a prompt without one is
refused by the runtime (Hugging Face skips the cross-attention layers then; the graph cannot).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from tfgraph import contract
from tfgraph.sources.vlm_families.family import Family, Probe

IMAGE_TILES = "image_tiles"  # the decoder's input: each row's aspect_ratio_mask (batch, tiles)


@dataclasses.dataclass(frozen=True)
class CrossAttentionFamily(Family):
    """A family whose text model reads the image through cross-attention: ``decoder(model,
    image_token, probe)`` is its decoder module (a :class:`CrossAttentionDecoder`), in place
    of the merge in front of the text model (:class:`tfgraph.sources.vlm_graphs
    .MergedDecoder`)."""

    decoder: Callable[[nn.Module, int, Probe], nn.Module] | None = None


def _features(model: nn.Module, _probe: Probe):
    """The vision model's output through the projector, (images, tiles × patches, hidden):
    ``MllamaModel.forward``'s ``cross_attention_states`` with a row per image."""
    inner = model.model
    hidden = inner.hidden_size

    def features(pixel_values, aspect_ratio_ids, aspect_ratio_mask) -> torch.Tensor:
        states = inner.vision_model(
            pixel_values=pixel_values,
            aspect_ratio_ids=aspect_ratio_ids,
            aspect_ratio_mask=aspect_ratio_mask,
        ).last_hidden_state  # (images, 1, tiles, patches, vision_output_dim)
        projected = inner.multi_modal_projector(states)
        return projected.reshape(projected.shape[0], -1, hidden)

    return features


class CrossAttentionDecoder(nn.Module):
    """The decoder graph: ``input_ids``, ``attention_mask``, ``image_features`` (the
    cross-attention states), ``image_tiles`` → ``logits``; positions from the padding mask, as
    ``generate`` computes them for left padding. ``row_inputs``: the per-row inputs besides the
    features, each the processor's tensor of that name (the runtime feeds them at every step)
    and its example row."""

    def __init__(self, model: nn.Module, image_token: int, probe: Probe) -> None:
        super().__init__()
        self.model, self.image_token = model, image_token
        self.patches = model.model.vision_model.num_patches
        tiles = probe.inputs["aspect_ratio_mask"].reshape(1, -1).long()
        self.row_inputs = {IMAGE_TILES: ("aspect_ratio_mask", tiles)}
        self.input_roles = {
            "image_features": contract.IMAGE_FEATURES,
            IMAGE_TILES: contract.IMAGE_TILES,
        }

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        image_features: torch.Tensor,
        image_tiles: torch.Tensor,
    ) -> torch.Tensor:
        from transformers.models.mllama.modeling_mllama import _prepare_cross_attention_mask

        # (B, T): the row's image token is at or before the token (a count of it, which the
        # KV cache pass continues past the cache: a generated token is after the image)
        after = torch.cumsum((input_ids == self.image_token).long(), -1) > 0
        # (B, T, 1 image, tiles) as the processor writes it; float: the exporter has no
        # ``1.0 - int64`` (Hugging Face's inversion of it)
        dtype = self.model.dtype  # the model's (an fp16 reference's): HF's mask dtype too
        image_features = image_features.to(dtype)
        tokens_tiles = after.to(dtype)[:, :, None, None] * image_tiles.to(dtype)[:, None, None, :]
        cross_mask, rows = _prepare_cross_attention_mask(
            tokens_tiles, num_vision_tokens=self.patches, dtype=dtype
        )
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        out = self.model.model.language_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            cross_attention_states=image_features,
            cross_attention_mask=cross_mask,
            full_text_row_masked_out_mask=rows,
            use_cache=False,
        )
        return self.model.lm_head(out.last_hidden_state)


MLLAMA = CrossAttentionFamily(
    _features,
    vision_inputs=("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"),
    batched=True,
    decoder=CrossAttentionDecoder,
)

FAMILIES = {"mllama": MLLAMA}
