"""What differs between vision-language families (:mod:`tfgraph.sources.vision_language`).

A family is one :class:`Family`, registered by ``model_type`` in
:data:`tfgraph.sources.vlm_families.FAMILIES`. Everything a family states is read off one
*probe*: the family's own processor run on one image at the export's input size
(:class:`Probe`), so the vision graph's inputs are the processor's tensors as a user's
processor writes them, and whatever the processor derives from the image's size (Qwen2-VL's
patch grid, Idefics3's tiles, LLaVA-NeXT's best resolution) is fixed by that size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

Tensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Probe:
    """The processor's tensors for one image of ``input_size`` (height, width) and the
    family's prompt; ``input_size`` None where no processor was saved (``pixel_values`` is
    then zeros at the vision tower's own size)."""

    inputs: dict[str, torch.Tensor]
    input_size: tuple[int, int] | None


@dataclass(frozen=True)
class MRope:
    """Multimodal RoPE (Qwen2-VL): a text token's three position ids (temporal, height,
    width) are its 1-D position; the k-th token of an image block gets the block's start plus
    ``coords[k]``, and every token after the block its 1-D position plus ``delta`` (the block
    spans ``max(coords) + 1`` positions, not its token count). ``coords``: (image tokens, 3)."""

    coords: torch.Tensor
    delta: int


@dataclass(frozen=True)
class Family:
    """How one family's graphs are made.

    - ``features(model, probe)``: a function of the vision graph's inputs (the probe's tensors
      named in ``vision_inputs``, as keywords) returning (images, image tokens, text hidden
      size); it may close over what the probe fixes (a patch grid);
    - ``batched``: the vision inputs' first axis is the image axis (the graph takes any
      number of images); False: one image per run, every shape fixed by the probe;
    - ``sized``: the processor's output shapes depend on the image's size, so the runtime
      resizes each image to the probe's ``input_size`` first;
    - ``merge``: ``block`` (a row's image tokens are one run) or ``rank`` (the k-th image
      token of the row, wherever it is, takes feature k: tiles between row markers);
    - ``mrope(model, probe)``: :class:`MRope` for families with 3-D position ids;
    - ``attention(model, image_token)``: a function of (``input_ids``, ``attention_mask``)
      returning the text model's ``attention_mask`` argument, for families whose prompt
      attends other than causally (Gemma 3's image blocks: :mod:`.gemma`); None: the padding
      mask, the model's own causal mask.
    """

    features: Callable[[nn.Module, Probe], Callable[..., torch.Tensor]]
    vision_inputs: tuple[str, ...] = ("pixel_values",)
    batched: bool = True
    sized: bool = False
    merge: str = "block"
    mrope: Callable[[nn.Module, Probe], MRope] | None = None
    deepstack: Callable[[nn.Module], int] | None = None
    attention: Callable[[nn.Module, int], Callable[..., object]] | None = None
    notes: tuple[str, ...] = field(default=())
    # ``around(model)``: token ids beside the image token that the features also replace, a
    # block with it (Ovis 2.5's image start and end take the block's first and last features)
    around: Callable[[nn.Module], tuple[int, ...]] | None = None
