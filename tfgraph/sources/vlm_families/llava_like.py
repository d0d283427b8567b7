"""LLaVA-like families beyond LLaVA 1.5: a vision tower and a projector, their features
merged at the image tokens of the text decoder's input.

- batched (any number of images per run): Video-LLaVA's image tower, GOT-OCR 2 and
  PP-Chart2Table, ViP-LLaVA, BLIP-2's Q-Former (its decoder-only OPT text model);
- one image per run at the probe's size, where the processor's shapes follow the image's:
  LLaVA-NeXT, LLaVA-NeXT-Video and LLaVA-OneVision (tiles by ``image_grid_pinpoints``),
  LightOnOCR (Pixtral's encoder at the image's size), Aya Vision (tiles between markers:
  merged by rank). The model's own ``get_image_features`` is handed the probe's
  ``image_sizes`` as host numbers, so its Python loops over tiles see numbers, not traced
  tensors.

Videos are out of scope: the video families export their image path."""

from __future__ import annotations

import torch
from torch import nn

from tfgraph.errors import TfgraphError
from tfgraph.sources.vlm_families.family import Family, Probe


def _selected(config, states) -> torch.Tensor:
    """The hidden states at ``vision_feature_layer`` (several: joined), CLS dropped by the
    ``default`` strategy: LLaVA's feature selection."""
    layers = config.vision_feature_layer
    layers = [layers] if isinstance(layers, int) else list(layers)
    picked = [states[i] for i in layers]
    if config.vision_feature_select_strategy == "default":
        picked = [h[:, 1:] for h in picked]
    return torch.cat(picked, dim=-1)


def _own(model: nn.Module, _probe: Probe):
    """The model's own ``get_image_features`` on the pixels, where it is a tower and a
    projector with no loop over the images (GOT-OCR 2, PP-Chart2Table, ViP-LLaVA): (images, tokens,
    hidden) as it comes."""

    def features(pixel_values: torch.Tensor) -> torch.Tensor:
        return model.model.get_image_features(pixel_values).pooler_output

    return features


def _blip2(model: nn.Module, _probe: Probe):
    """BLIP-2: the vision model, the Q-Former's query outputs, the language projection (the
    model's own ``get_image_features``, batched). Only a decoder-only text model (OPT) takes
    the merged embeddings in one decoder graph; a Flan-T5 one is an encoder-decoder."""
    if not getattr(model.config, "use_decoder_only_language_model", True):
        raise TfgraphError(
            "BLIP-2 with an encoder-decoder text model (Flan-T5) is not exported whole; only "
            "its decoder-only (OPT) checkpoints are"
        )

    def features(pixel_values: torch.Tensor) -> torch.Tensor:
        return model.get_image_features(pixel_values).pooler_output  # (B, queries, hidden)

    return features


def _tiles(model: nn.Module, _probe: Probe):
    """Aya Vision's tiles: the processor cuts one image into tiles (their count follows the
    image's size) that share the first axis of ``pixel_values``; each tile's features, in
    order, are the image's, joined into one row (its image tokens sit between tile markers:
    merged by rank)."""

    def features(pixel_values: torch.Tensor) -> torch.Tensor:
        out = model.model.get_image_features(pixel_values).pooler_output  # (tiles, N, H)
        return out.reshape(1, -1, out.shape[-1])

    return features


def _video_llava(model: nn.Module, _probe: Probe):
    """Video-LLaVA's image half: its ``image_tower`` (the ``video_tower`` is not traced: video
    inputs are out of scope), LLaVA's selection, the shared projector."""
    inner = model.model

    def features(pixel_values_images: torch.Tensor) -> torch.Tensor:
        out = inner.image_tower(pixel_values_images, output_hidden_states=True)
        return inner.multi_modal_projector(_selected(model.config, out.hidden_states))

    return features


def _anyres(model: nn.Module, probe: Probe):
    """LLaVA-NeXT's tiles: the processor cuts the image into the base tile and the tiles of
    the grid ``image_grid_pinpoints`` picks for its size, the model unpads and packs their
    features (a newline feature after each row) by ``image_sizes``. Both follow the image's
    size, so the graph is made for the probe's size (one image per run) and the model's own
    ``get_image_features`` is handed the probe's ``image_sizes`` as a NumPy array: its Python
    loops over the tiles then see numbers, not traced tensors."""
    sizes = probe.inputs["image_sizes"]
    if sizes.shape[0] != 1:
        raise TfgraphError(f"the probe holds {sizes.shape[0]} images; the vision graph takes one")
    sizes = sizes.numpy()

    def features(pixel_values: torch.Tensor) -> torch.Tensor:
        out = model.model.get_image_features(pixel_values, image_sizes=sizes)
        return out.pooler_output[0][None]  # (1, image tokens, hidden)

    return features


def _pixtral(model: nn.Module, probe: Probe):
    """A Pixtral vision encoder (LightOnOCR): the image at its own size, its patches cut and
    merged by ``image_sizes`` in Python loops; the model's own ``get_image_features`` is
    handed the probe's sizes as Python numbers (one image per run at the probe's size)."""
    sizes = probe.inputs["image_sizes"]
    if sizes.shape[0] != 1:
        raise TfgraphError(f"the probe holds {sizes.shape[0]} images; the vision graph takes one")
    sizes = [tuple(int(v) for v in row) for row in sizes]

    def features(pixel_values: torch.Tensor) -> torch.Tensor:
        out = model.model.get_image_features(pixel_values, image_sizes=sizes)
        return out.pooler_output[0][None]  # (1, image tokens, hidden)

    return features


_ANYRES = {"vision_inputs": ("pixel_values",), "batched": False, "sized": True}

FAMILIES: dict[str, Family] = {
    "llava_next": Family(_anyres, **_ANYRES),
    "llava_next_video": Family(_anyres, **_ANYRES),  # images only: video inputs out of scope
    "llava_onevision": Family(_anyres, **_ANYRES),  # images only: video inputs out of scope
    "blip-2": Family(_blip2),
    "got_ocr2": Family(_own),
    "vipllava": Family(_own),
    "pp_chart2table": Family(_own),
    "lighton_ocr": Family(_pixtral, **_ANYRES),
    "aya_vision": Family(_tiles, **_ANYRES, merge="rank"),
    "video_llava": Family(_video_llava, vision_inputs=("pixel_values_images",)),
}
