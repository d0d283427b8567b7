"""LLaVA 1.5: a CLIP vision tower, the feature layer(s) without CLS, a 2-layer projector."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from tfgraph.sources.vlm_families.family import Family, Probe


def llava_features(model: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """The vision tower's hidden states at ``vision_feature_layer`` (several: joined), CLS
    dropped by the ``default`` strategy, through the projector: transformers'
    ``get_image_features`` without its split into a list per image (a loop over the batch,
    which torch.export would fix to the batch it traced)."""
    config, inner = model.config, model.model
    states = inner.vision_tower(pixel_values, output_hidden_states=True).hidden_states
    layers = config.vision_feature_layer
    layers = [layers] if isinstance(layers, int) else list(layers)
    picked = [states[i] for i in layers]
    if config.vision_feature_select_strategy == "default":
        picked = [h[:, 1:] for h in picked]
    return inner.multi_modal_projector(torch.cat(picked, dim=-1))  # (B, N, H)


def _llava(model: nn.Module, _probe: Probe):
    return partial(llava_features, model)


FAMILIES = {"llava": Family(_llava)}
