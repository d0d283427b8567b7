"""Layouts of a Hugging Face model's non-token main input, read off its config: images
(``pixel_values``), raw audio (``input_values``), speech features (``input_features``)."""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from tfgraph.errors import TfgraphError

logger = logging.getLogger(__name__)

# make(batch, length, generator) of one input; ``length`` is its dynamic axis' size
_Make = Callable[[int, int, torch.Generator], torch.Tensor]


def _float_maker(shape_at: Callable[[int, int], tuple[int, ...]]) -> _Make:
    def make(batch, length, generator):
        return torch.randn(shape_at(batch, length), generator=generator)

    return make


def _image_size(config) -> tuple[int, int] | None:
    """The image size the config states, or its vision sub-config does (CLIP's and SigLIP's
    image classifiers take a composite config whose ``vision_config`` holds it)."""
    size = _stated(config, "image_size")
    if isinstance(size, int) and size > 0:
        return size, size
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return int(size[0]), int(size[1])
    return None


def _stated(config, *names: str):
    """The first of ``names`` the config states, or one of its sub-configs (an ASR model's
    ``encoder_config``) does; None if none."""
    configs = [config]
    configs += [getattr(config, n, None) for n in getattr(config, "sub_configs", None) or {}]
    for cfg in configs:
        for name in names:
            value = getattr(cfg, name, None) if cfg is not None else None
            if value:
                return value
    return None


NAFLEX_INPUTS = ("pixel_attention_mask", "spatial_shapes")


def naflex(model: nn.Module, config) -> tuple[_Make, Callable[[int], dict]] | None:
    """SigLIP 2's NaFlex images, when the model's forward takes ``NAFLEX_INPUTS``: (make of
    ``pixel_values`` already cut into patches, (batch, patches, channels × patch × patch), make
    of the companion inputs for a batch), else None. ``spatial_shapes`` (batch, 2) is each
    image's grid of patches (rows, columns), ``pixel_attention_mask`` (batch, patches) which
    patches are real: the first image fills a square grid, the others one row fewer, the
    patches left over are padding (the processor pads every image to ``num_patches``)."""
    params = inspect.signature(model.forward).parameters
    patches, size = _stated(config, "num_patches"), _stated(config, "patch_size")
    if not all(n in params for n in NAFLEX_INPUTS) or not isinstance(patches, int):
        return None
    if not isinstance(size, int):
        return None
    channels = _stated(config, "num_channels") or 3
    side = math.isqrt(patches)

    def make(batch, _length, generator):
        return torch.randn(batch, patches, channels * size * size, generator=generator)

    def companions(batch):
        grids = [[side, side]] + [[max(side - 1, 1), side]] * (batch - 1)
        shapes = torch.tensor(grids, dtype=torch.int64)  # (B, 2)
        real = torch.arange(patches)[None, :] < shapes.prod(-1)[:, None]  # (B, patches)
        return {"pixel_attention_mask": real.long(), "spatial_shapes": shapes}

    return make, companions


def candidates(model: nn.Module, config, main: str) -> list[tuple[_Make, int | None, int]]:
    """(make, length axis, base length) layouts to try for a non-token main input, the most
    specific first."""
    if main == "pixel_values":
        size = _image_size(config)
        if size is None:  # a ConvNet takes any size: the common 224 × 224
            logger.warning("%s states no image_size: 224 × 224 images", type(model).__name__)
            size = (224, 224)
        channels = getattr(config, "num_channels", 3) or 3
        return [(_float_maker(lambda b, _n: (b, channels, *size)), None, 0)]
    if main == "input_values":  # raw audio (batch, samples), else (batch, 1, samples): OmniASR
        bases = (1600, 4000, 16000)
        flat = [(_float_maker(lambda b, n: (b, n)), 1, base) for base in bases]
        mono = [(_float_maker(lambda b, n: (b, 1, n)), 2, base) for base in bases]
        return flat + mono
    if main == "input_features":
        found = []
        mel = _stated(config, "num_mel_bins")
        fixed = getattr(config, "max_source_positions", None)
        if mel:
            if fixed:  # Whisper: frames = 2 × max_source_positions exactly
                found.append((_float_maker(lambda b, n: (b, mel, n)), 2, 2 * fixed))
            found += [(_float_maker(lambda b, n: (b, mel, n)), 2, base) for base in (64, 200)]
        per_channel = getattr(config, "input_feat_per_channel", None)
        features = (
            per_channel * (getattr(config, "input_channels", 1) or 1)
            if per_channel
            else _stated(config, "feature_size", "feature_projection_input_dim")
        )
        if features:  # Speech2Text and the like: (batch, frames, features)
            found += [(_float_maker(lambda b, n: (b, n, features)), 1, base) for base in (64, 200)]
        if mel:  # mel frames last (Parakeet, LASR, Cohere ASR: (batch, frames, mel bins))
            found += [(_float_maker(lambda b, n: (b, n, mel)), 1, base) for base in (64, 200)]
        if found:
            return found
        raise TfgraphError(
            f"{type(model).__name__} takes input_features but its config states neither "
            "num_mel_bins nor input_feat_per_channel/feature_size"
        )
    raise TfgraphError(
        f"{type(model).__name__}'s main input '{main}' is not one tfgraph can make "
        "(input_ids, input_features, input_values, pixel_values); wrap the model in a module "
        "with the tfgraph input protocol"
    )
