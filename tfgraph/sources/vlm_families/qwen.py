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

import inspect

import torch
from torch import nn

from tfgraph.errors import TfgraphError
from tfgraph.sources.vlm_families.family import Family, MRope, Probe


def _qwen_features(model: nn.Module, probe: Probe):
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

    grid = probe.inputs["image_grid_thw"]
    if grid.shape[0] != 1:
        raise TfgraphError(f"the probe holds {grid.shape[0]} images; the vision graph takes one")
    visual = model.model.visual
    cu_seqlens = get_vision_cu_seqlens(grid).numpy()  # one chunk: the whole image
    positions = get_vision_position_ids(grid, visual.spatial_merge_size)

    def features(pixel_values: torch.Tensor) -> torch.Tensor:
        out = visual(
            pixel_values.to(visual.dtype),
            grid_thw=grid,
            cu_seqlens=cu_seqlens,
            position_ids=positions,
        )
        return out.pooler_output[None]  # (1, image tokens, hidden)

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


QWEN2_VL = Family(
    _qwen_features,
    vision_inputs=("pixel_values",),
    batched=False,
    sized=True,
    mrope=_mrope,
)

FAMILIES = {"qwen2_vl": QWEN2_VL}
