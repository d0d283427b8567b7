"""Qwen2-VL and the families built like it: a vision tower over the processor's flattened
patches (``pixel_values`` (patches, channels × temporal × patch²) with ``image_grid_thw``),
its patch merger's output as the features, and M-RoPE's 3-D position ids in the text model.

The processor's grid follows the image's size, so the vision graph is made for the probe's
grid (one image per run, every shape fixed) and the runtime resizes each image to the probe's
size first. The tower's attention is split per image by ``cu_seqlens`` with a ``.tolist()``
that torch.export cannot follow on a traced tensor; for one image of a known grid both the
split (handed in as a NumPy array: one chunk) and the rotary positions are computed once,
from the probe, and handed to the tower as transformers' own precomputed keywords."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys

import numpy as np
import torch
from torch import nn

from tfgraph.errors import TfgraphError
from tfgraph.sources.vlm_families.family import Family, MRope, Probe

# transformers' vision helpers that take their result precomputed from the tower's keywords
# (vision_utils.py), and the keywords each result goes by
_HELPERS = {
    "get_vision_attention_seqlens": ("cu_seqlens", "max_seqlen"),
    "get_vision_cu_seqlens": ("cu_seqlens",),
    "get_vision_position_ids": ("position_ids",),
    "get_vision_window_index": ("window_index", "cu_window_seqlens"),
    "get_vision_interpolation_indices_and_weights": ("interp_indices", "interp_weights"),
    "get_vision_bilinear_indices_and_weights": ("bilinear_indices", "bilinear_weights"),
    "get_vision_nearest_position_ids": ("position_ids",),
    "get_vision_merged_shape": ("merged_shape",),
}
_SPLITS = ("cu_seqlens", "cu_window_seqlens")  # split by .tolist(): handed in as _Static


class _Static(np.ndarray):
    """Integer boundaries known when the graph is made: a NumPy array, so the ``.tolist()``
    a tower splits its attention by is a constant under torch.export, where the same values
    in a tensor would be data-dependent; any other tensor method (GLM-4V's ``.unsqueeze`` of
    their cumulative sum) answers as the constant tensor of the same values."""

    def __getattr__(self, name: str):
        return getattr(torch.from_numpy(np.ascontiguousarray(self)), name)


@contextlib.contextmanager
def _recording(tower: nn.Module, recorded: dict):
    """While active, the vision helpers the tower's module calls record their results in
    ``recorded`` (the first result of each keyword)."""
    module = sys.modules[type(tower).__module__]
    originals = {n: getattr(module, n) for n in _HELPERS if hasattr(module, n)}

    def wrap(name, original):
        def helper(*args, **kwargs):
            result = original(*args, **kwargs)
            keys = _HELPERS[name]
            values = result if len(keys) > 1 else (result,)
            for key, value in zip(keys, values, strict=True):
                recorded.setdefault(key, value)
            return result

        return helper

    for name, original in originals.items():
        setattr(module, name, wrap(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


def precomputed(tower: nn.Module, pixel_values: torch.Tensor, grid: torch.Tensor, run=None):
    """What the tower derives from the patch grid alone (rotary positions, the per-image and
    per-window splits, window order, position-table interpolation), recorded from one eager
    run on the probe (``run()``; default: the tower on the pixels and grid): handed back as
    keywords, the traced tower computes none of it."""
    recorded: dict = {}
    with torch.no_grad(), _recording(tower, recorded):
        if run is not None:
            run()
        else:
            tower(pixel_values.to(tower.dtype), grid_thw=grid)
    for key in _SPLITS:
        if isinstance(recorded.get(key), torch.Tensor):
            recorded[key] = recorded[key].numpy().view(_Static)
    return recorded


def _qwen_features(model: nn.Module, probe: Probe, deepstack: bool = False):
    """The merger's output; with DeepStack (Qwen3-VL), each DeepStack merger's after it,
    joined on the last axis."""
    grid = probe.inputs["image_grid_thw"]
    if grid.shape[0] != 1:
        raise TfgraphError(f"the probe holds {grid.shape[0]} images; the vision graph takes one")
    tower = model.model.visual
    fixed = precomputed(tower, probe.inputs["pixel_values"], grid)

    def features(pixel_values: torch.Tensor) -> torch.Tensor:
        out = tower(pixel_values.to(tower.dtype), grid_thw=grid, **fixed)
        layers = out.deepstack_features if deepstack else []
        return torch.cat([out.pooler_output, *layers], -1)[None]  # (1, tokens, hidden…)

    return features


def _mrope(model: nn.Module, probe: Probe) -> MRope:
    """The image block's offsets and the delta after it, from the model's own
    ``get_rope_index`` on the probe's prompt (one row, one image)."""
    inputs = probe.inputs
    method = model.model.get_rope_index
    accepted = inspect.signature(method).parameters
    kwargs = {k: v for k, v in inputs.items() if k in accepted and k != "input_ids"}
    with torch.no_grad():
        positions, deltas = method(inputs["input_ids"], **kwargs)
    ids = inputs["input_ids"][0]
    image = ids == model.config.image_token_id
    where = image.nonzero().flatten()
    start, count = int(where[0]), int(image.sum())
    if int(where[-1]) - start + 1 != count:
        raise TfgraphError("the probe's image tokens are not one block")
    coords = positions[:, 0, start : start + count].T - start  # (N, 3)
    return MRope(coords.long(), int(deltas.flatten()[0]))


def _paddle_features(model: nn.Module, probe: Probe):
    """PaddleOCR-VL: a SigLIP-like tower over the patches (one image: (1, patches, C, P, P)),
    then its projector's 2 × 2 merge for the probe's grid. The projector's own code splits and
    loops over images by the grid's values; for one image of a known grid its steps are done
    here with its own layers (norm, the merge's reshape, the two linears)."""
    grid = probe.inputs["image_grid_thw"]
    tower, projector = model.model.visual, model.model.projector
    t, h, w = (int(v) for v in grid[0])
    m1, m2 = projector.merge_kernel_size

    def tower_states(pixel_values, **fixed):
        pixels = pixel_values.to(tower.dtype).unsqueeze(0)
        return tower(pixel_values=pixels, grid_thw=grid, **fixed).last_hidden_state

    fixed = precomputed(tower, None, grid, run=lambda: tower_states(probe.inputs["pixel_values"]))

    def features(pixel_values: torch.Tensor) -> torch.Tensor:
        states = tower_states(pixel_values, **fixed)
        d = states.shape[-1]
        states = projector.pre_norm(states.reshape(-1, d))  # (patches, d): one image
        states = states.reshape(t, h // m1, m1, w // m2, m2, d).transpose(2, 3)
        states = states.reshape(t * (h // m1) * (w // m2), m1 * m2 * d)
        return projector.linear_2(projector.act(projector.linear_1(states)))[None]

    return features


def _deepstack_layers(model: nn.Module) -> int:
    return len(model.config.vision_config.deepstack_visual_indexes)


QWEN2_VL = Family(
    _qwen_features,
    vision_inputs=("pixel_values",),
    batched=False,
    sized=True,
    mrope=_mrope,
)
QWEN3_VL = dataclasses.replace(
    QWEN2_VL,
    features=functools.partial(_qwen_features, deepstack=True),
    deepstack=_deepstack_layers,
)

# built like Qwen2-VL: the tower at model.model.visual, its merger's output as the features,
# get_rope_index for M-RoPE (windowed towers and interpolated position tables recorded too)
FAMILIES = (
    {
        "qwen3_vl": QWEN3_VL,
        "qwen3_vl_moe": QWEN3_VL,
    }
    | {
        name: QWEN2_VL
        for name in (
            "qwen2_vl",
            "qwen2_5_vl",
            "qwen3_5",
            "qwen3_5_moe",
            "qwen4_exp",
            "glm4v",
            "glm46v",
            "glm4v_moe",
        )
    }
    | {"paddleocr_vl": dataclasses.replace(QWEN2_VL, features=_paddle_features)}
)
