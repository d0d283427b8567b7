"""Idefics2, Idefics3 and SmolVLM: a SigLIP-like vision tower over the processor's tiles
(``pixel_values`` (images, tiles, channels, H, W) with ``pixel_attention_mask`` (images,
tiles, H, W)), a connector (Idefics3/SmolVLM: pixel shuffle and a projection; Idefics2: a
perceiver resampler) and a Llama-like text model whose image tokens sit between tile markers.

The tile count follows the image's size (the processor splits a large image into tiles and
adds a global one), so the runtime resizes each image to the probe's size first and every
image has the probe's tiles. Transformers' ``get_image_features`` drops all-zero padding
tiles with a boolean index and splits the features per image with ``.tolist()``, neither of
which torch.export follows; at one size no tile is padding, so the tiles are folded into the
batch and back. The k-th image token of a row, wherever its tile's markers put it, takes
feature k (``merge="rank"``), as transformers' ``masked_scatter`` does.
"""

from __future__ import annotations

import torch
from torch import nn

from tfgraph.sources.vlm_families.family import Family, Probe


def patch_mask(pixel_mask: torch.Tensor, patch: int, full: bool) -> torch.Tensor:
    """(tiles, H, W) pixel mask → (tiles, H / patch, W / patch) patch mask: a patch is real
    when all (``full``: Idefics2) or any (Idefics3, SmolVLM) of its pixels are."""
    cells = pixel_mask.unfold(1, patch, patch).unfold(2, patch, patch).sum(dim=(-1, -2))
    return cells == patch * patch if full else cells > 0


def _features(model: nn.Module, _probe: Probe, full: bool, resampler: bool):
    inner = model.model
    patch = model.config.vision_config.patch_size

    def features(pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor):
        images, tiles = pixel_values.shape[:2]
        pixels = pixel_values.flatten(0, 1).to(inner.vision_model.dtype)
        mask = patch_mask(pixel_attention_mask.flatten(0, 1), patch, full)
        hidden = inner.vision_model(pixel_values=pixels, patch_attention_mask=mask)
        hidden = hidden.last_hidden_state
        if resampler:
            out = inner.connector(hidden, attention_mask=mask.flatten(1))
        else:
            out = inner.connector(hidden)
        return out.reshape(images, tiles * out.shape[1], out.shape[2])  # (B, N, H)

    return features


def _idefics3(model: nn.Module, probe: Probe):
    return _features(model, probe, full=False, resampler=False)


def _idefics2(model: nn.Module, probe: Probe):
    return _features(model, probe, full=True, resampler=True)


_TILED = {"vision_inputs": ("pixel_values", "pixel_attention_mask"), "sized": True}
IDEFICS3 = Family(_idefics3, merge="rank", **_TILED)

FAMILIES: dict[str, Family] = {
    "idefics3": IDEFICS3,
    "smolvlm": IDEFICS3,
    "idefics2": Family(_idefics2, merge="rank", **_TILED),
}
