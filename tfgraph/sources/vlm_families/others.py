"""Vision-language families built on Qwen2-VL's vision side (a tower over the processor's
flattened patches with ``image_grid_thw``) whose towers, projectors and text positions
differ: 1-D positions (EXAONE 4.5, HyperCLOVA X Vision v2, LFM3-VL, Ovis 2.5, VideoLLaMA 3)
or M-RoPE's 3-D ones (Cosmos 3 Edge, HunYuan-VL, HY-V4-VL).

As for Qwen2-VL (:mod:`.qwen`), the processor's grid follows the image's size, so each vision
graph is made for the probe's grid (one image per run, the runtime resizing every image to
the probe's size). The features are the model's own ``get_image_features``; what it derives
from the grid on the host (the attention's per-image split, rotary and interpolated position
tables, the window order, reshapes and splits by ``.tolist()`` or a Python loop) cannot be
traced from a tensor, so the grid is handed in as a :class:`HostGrid` (a NumPy array: its
arithmetic stays Python numbers) and the tables as transformers' precomputed keywords, the
attention split as a NumPy array the traced attention reads as constants."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tfgraph.errors import TfgraphError
from tfgraph.sources.vlm_families.family import Family, Probe
from tfgraph.sources.vlm_families.qwen import _mrope


class HostGrid(np.ndarray):
    """``image_grid_thw`` (or ``image_merge_sizes``) as a NumPy array answering the few
    tensor methods the towers call on it (``prod(dim=)``, ``unbind``), so the sizes it gives
    are Python numbers when traced, not data-dependent ones."""

    def prod(self, dim=None, axis=None, **kwargs):
        return np.ndarray.prod(self, axis=dim if dim is not None else axis, **kwargs)

    def unbind(self, dim=0):
        return tuple(np.moveaxis(np.asarray(self), dim, 0).view(HostGrid))


def _host(value: torch.Tensor) -> HostGrid:
    return value.numpy().view(HostGrid)


def _grid(probe: Probe) -> torch.Tensor:
    grid = probe.inputs["image_grid_thw"]
    if grid.shape[0] != 1:
        raise TfgraphError(f"the probe holds {grid.shape[0]} images; the vision graph takes one")
    return grid


def _precomputed(tower: nn.Module, grid: torch.Tensor, merge=None, window=False) -> dict:
    """The tower's precomputed keywords for one image of ``grid``: its attention as one
    chunk (a NumPy array), the rotary positions (``merge``: the spatial merge size or sizes)
    and, with ``window``, Qwen2.5-VL's window order and chunks."""
    from transformers import vision_utils as vu

    kwargs = {"cu_seqlens": vu.get_vision_cu_seqlens(grid).numpy()}
    if merge is not None:
        kwargs["position_ids"] = vu.get_vision_position_ids(grid, merge)
    if window:
        config = tower.config
        index, chunks = vu.get_vision_window_index(
            grid, config.spatial_merge_size, config.window_size, config.patch_size
        )
        kwargs.update(window_index=index, cu_window_seqlens=chunks.numpy())
    return kwargs


def _image_features(model: nn.Module, probe: Probe, precomputed: dict, extra=()):
    """``get_image_features(pixel_values, grid, *extra, **precomputed)``'s one image as
    (1, image tokens, hidden); ``extra``: more of the probe's per-image tensors, as host
    values (VideoLLaMA 3's merge sizes)."""
    grid = _host(_grid(probe))
    more = [_host(probe.inputs[name]) for name in extra]
    inner = model.model

    def features(pixel_values: torch.Tensor) -> torch.Tensor:
        out = inner.get_image_features(pixel_values, grid, *more, **precomputed)
        pooled = out.pooler_output
        return torch.cat(list(pooled), 0)[None] if isinstance(pooled, (list, tuple)) else pooled

    return features


def _exaone(model: nn.Module, probe: Probe):
    """EXAONE 4.5: Qwen2.5-VL's windowed tower and merger."""
    tower = model.model.visual
    pre = _precomputed(tower, _grid(probe), tower.spatial_merge_size, window=True)
    return _image_features(model, probe, pre)


def _hyperclovax(model: nn.Module, probe: Probe):
    """HyperCLOVA X Vision v2: a Qwen2.5-VL tower, then a linear projector."""
    tower = model.model.vision_model
    pre = _precomputed(tower, _grid(probe), tower.spatial_merge_size, window=True)
    return _image_features(model, probe, pre)


def _lfm3(model: nn.Module, probe: Probe):
    """LFM3-VL: attention and convolution layers over the grid (reshaped by its host sizes)."""
    tower = model.model.vision_tower
    pre = _precomputed(tower, _grid(probe), tower.spatial_merge_size)
    return _image_features(model, probe, pre)


def _ovis(model: nn.Module, probe: Probe):
    """Ovis 2.5: a windowed tower whose position table is interpolated to the grid; its
    image start and end tokens take fixed indicator embeddings, the block's first and last
    features here."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    tower, grid = model.model.vision_tower, _grid(probe)
    pre = _precomputed(tower, grid, tower.spatial_merge_size, window=True)
    embed = tower.embeddings
    pre["interp_indices"], pre["interp_weights"] = get_vision_interpolation_indices_and_weights(
        grid,
        embed.num_grid_per_side,
        mode=embed.interpolation_mode,
        align_corners=embed.interpolation_align_corners,
        spatial_merge_size=embed.spatial_merge_size,
    )
    inner = _image_features(model, probe, pre)
    projector = model.model.multi_modal_projector

    def features(pixel_values: torch.Tensor) -> torch.Tensor:
        """The image's features between its start and end indicators (the embeddings the
        model puts at the image start and end tokens: :func:`_ovis_around`)."""
        image = inner(pixel_values)
        marks = projector.get_visual_indicator_features(image.device).to(image.dtype)
        return torch.cat([marks[None, 0:1], image, marks[None, 1:2]], 1)

    return features


def _ovis_around(model: nn.Module) -> tuple[int, int]:
    config = model.config
    return config.image_start_token_id, config.image_end_token_id


def _video_llama(model: nn.Module, probe: Probe):
    """VideoLLaMA 3: the tower's output pooled per image by the processor's merge size."""
    sizes = probe.inputs["image_merge_sizes"]
    pre = _precomputed(model.model.vision_model, _grid(probe), sizes)
    return _image_features(model, probe, pre, extra=("image_merge_sizes",))


def _split_only(model: nn.Module, probe: Probe):
    """Towers whose positions are a learned table resized on the host (Cosmos 3 Edge,
    HunYuan-VL, HY-V4-VL: the latter two add a newline feature after each merged row and,
    HunYuan-VL, the image's start and end features): only the attention split precomputed."""
    return _image_features(model, probe, _precomputed(None, _grid(probe)))


_ONE_IMAGE = {"vision_inputs": ("pixel_values",), "batched": False, "sized": True}

FAMILIES: dict[str, Family] = {
    "exaone4_5": Family(_exaone, **_ONE_IMAGE),
    "hyperclovax_vision_v2": Family(_hyperclovax, **_ONE_IMAGE),
    "lfm3_vl": Family(_lfm3, **_ONE_IMAGE),
    "ovis2_5": Family(_ovis, around=_ovis_around, **_ONE_IMAGE),
    "video_llama_3": Family(_video_llama, **_ONE_IMAGE),
    "cosmos3_edge": Family(_split_only, mrope=_mrope, **_ONE_IMAGE),
    "hunyuan_vl": Family(_split_only, mrope=_mrope, **_ONE_IMAGE),
    "hy_v4_vl": Family(_split_only, mrope=_mrope, **_ONE_IMAGE),
}
