"""The two modules a vision-language model's graphs are traced from
(:mod:`tfgraph.sources.vision_language`): the vision graph's :class:`VisionFeatures` and the
decoder's :class:`MergedDecoder` (the merge of the image features at the image tokens, the
positions, the text model)."""

from __future__ import annotations

import torch
from torch import nn

from tfgraph import contract
from tfgraph.sources.vlm_families.family import Family, MRope, Probe

ROPE_DELTAS = "rope_deltas"  # the M-RoPE decoder's input: each row's offset after its image


class VisionFeatures(nn.Module):
    """The vision graph: the family's vision inputs (``pixel_values``, and what else its
    processor writes per image) → ``image_features`` (images, image tokens, hidden)."""

    output_roles = {"image_features": contract.IMAGE_FEATURES}

    def __init__(self, model: nn.Module, family: Family, probe: Probe) -> None:
        super().__init__()
        self.model, self.names = model, family.vision_inputs
        if len(self.names) > 4:
            raise ValueError(f"a vision graph takes at most 4 inputs, not {self.names}")
        self.family, self.probe = family, probe
        self.compute = family.features(model, probe)
        self.input_roles = {self.names[0]: contract.PIXEL_VALUES}  # the pixels, as named

    def __deepcopy__(self, memo) -> VisionFeatures:
        """A copy whose features compute with the copied model: ``compute`` is the family's
        function closing over this model's tower, which a plain deepcopy shares (functions
        are not copied), so the int4 reference's dequantized weights, set on the copy, went
        unused (Qwen2-VL's vision parity at int4 compared the fp32 tower: max abs 0.022)."""
        import copy

        new = object.__new__(type(self))
        memo[id(self)] = new
        shared = ("compute", "family", "probe")
        for key, value in self.__dict__.items():
            new.__dict__[key] = value if key in shared else copy.deepcopy(value, memo)
        new.compute = self.family.features(new.model, self.probe)
        return new

    def forward(
        self,
        pixel_values: torch.Tensor,
        second: torch.Tensor | None = None,
        third: torch.Tensor | None = None,
        fourth: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The inputs in ``vision_inputs`` order, by position (named parameters, not
        ``*inputs``: torch.export takes a star argument as one tuple)."""
        inputs = (pixel_values, second, third, fourth)[: len(self.names)]
        return self.compute(**dict(zip(self.names, inputs, strict=True)))


def is_image_token(input_ids: torch.Tensor, image_token: int | tuple[int, ...]) -> torch.Tensor:
    """(B, T) bool: the image token, or any of several ids where tokens around the image
    take features too (:attr:`Family.around`)."""
    tokens = (image_token,) if isinstance(image_token, int) else tuple(image_token)
    found = input_ids == tokens[0]
    for token in tokens[1:]:
        found = found | (input_ids == token)
    return found


def image_slots(
    input_ids: torch.Tensor, count, image_token: int | tuple[int, ...], merge: str = "block"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, take), both (B, T): token t of a row takes feature ``index - 1`` where ``take``
    (the k-th image token of the row, k < ``count``). ``merge``: ``block``, a row's image
    tokens are one run as the processor writes them, its k-th token the one k positions after
    the first (an ArgMax, no CumSum, so a step after the prompt reads no count of the past);
    ``rank``: the k-th image token wherever it is (tiles between row markers), a CumSum of the
    image tokens, which the KV cache pass continues past the cache, so a later step's count
    exceeds its (empty) features."""
    is_image = is_image_token(input_ids, image_token)  # (B, T)
    if merge == "rank":
        index = torch.cumsum(is_image.long(), -1)  # 1 … N at the image tokens
    else:
        first = is_image.float().argmax(-1, keepdim=True)  # (B, 1): the block's first position
        index = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :] - first + 1
    take = is_image & (index >= 1) & (index <= count)  # (B, T), index 1 … N
    # a scalar 0 elsewhere: a zeros_like of the rank merge's CumSum is an Expand of its shape,
    # which the KV cache pass cuts to a negative length (Idefics3's decoder failed in ORT)
    return torch.where(take, index, 0), take


def gather_features(features: torch.Tensor, index: torch.Tensor, zero: torch.Tensor | None):
    """(B, T, H): ``features`` (B, N, H) at ``index`` (B, T; 0 a zero row, k feature k - 1).
    ``zero``: a (1, 1, H) zero row, a weight of the module (a zero tensor made in the graph is
    a ConstantOfShape whose fp32 value ``--precision fp16`` does not convert)."""
    if zero is None:
        zero = features.new_zeros(1, 1, features.shape[2])
    padded = torch.cat([zero.expand(features.shape[0], -1, -1), features], 1)  # (B, 1 + N, H)
    return torch.gather(padded, 1, index[..., None].expand(-1, -1, features.shape[2]))


def merge_image_features(
    embeds: torch.Tensor,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    image_token: int | tuple[int, ...],
    zero: torch.Tensor | None = None,
    merge: str = "block",
) -> torch.Tensor:
    """``embeds`` (B, T, H) with the k-th image token of each row replaced by
    ``features[b, k]`` (B, N, H); image tokens past the N-th (or all, when N is 0) keep their
    embedding (:func:`image_slots`)."""
    index, take = image_slots(input_ids, features.shape[1], image_token, merge)
    picked = gather_features(features, index, zero)
    return torch.where(take[..., None], picked.to(embeds.dtype), embeds)  # (B, T, H)


def mrope_positions(
    positions: torch.Tensor,
    input_ids: torch.Tensor,
    image_token: int | tuple[int, ...],
    coords: torch.Tensor,
    deltas: torch.Tensor,
) -> torch.Tensor:
    """Qwen2-VL's (3, B, T) position ids from the 1-D ``positions`` (B, T): a token before a
    row's image block keeps its position on all three axes, the block's k-th token gets the
    block's start plus ``coords[k]`` (N, 3), every later token its position plus the row's
    ``deltas`` (B, 1): what Hugging Face's ``get_rope_index`` computes for one image per row,
    and, fed the same deltas, what its cached steps compute (``rope_deltas``)."""
    is_image = is_image_token(input_ids, image_token)
    first = is_image.float().argmax(-1, keepdim=True)  # (B, 1); 0 in a row without an image
    index = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :] - first
    count = coords.shape[0]
    inside = is_image & (index >= 0) & (index < count)
    k = torch.where(inside, index, torch.zeros_like(index))  # (B, T)
    block = coords[k] - k[..., None]  # (B, T, 3): the k-th token's offsets from start + k
    after = torch.where(index < 0, torch.zeros_like(deltas), deltas)  # (B, T)
    extra = torch.where(inside[..., None], block, after[..., None])  # (B, T, 3)
    # added batch-first: the KV cache pass slices the (batch, sequence) positions per row
    return (positions[..., None] + extra).permute(2, 0, 1)


def _text_attr(model: nn.Module) -> str | None:
    """None where the VLM's own forward takes the merged embeddings without pixels; else the
    attribute of the language model they go through (BLIP-2's forward requires
    ``pixel_values``: its ``language_model``, a causal LM). An attribute name, not the module:
    the decoder's weights keep the VLM's names."""
    import inspect

    pixels = inspect.signature(model.forward).parameters.get("pixel_values")
    if pixels is None or pixels.default is not inspect.Parameter.empty:
        return None
    if isinstance(getattr(model, "language_model", None), nn.Module):
        return "language_model"
    return None


class MergedDecoder(nn.Module):
    """The decoder graph: ``input_ids``, ``attention_mask``, ``image_features`` (and, with
    M-RoPE, ``rope_deltas``) → ``logits``: the merge, then the text model on the embeddings;
    positions from the padding mask, as ``generate`` computes them for left padding. With
    ``deepstack`` layers, ``image_features`` holds each such layer's features after the merged
    ones (hidden × (1 + deepstack)), added at the image tokens after that layer."""

    def __init__(
        self,
        model: nn.Module,
        image_token: int,
        merge: str = "block",
        mrope: MRope | None = None,
        deepstack: int = 0,
        attention=None,
    ) -> None:
        super().__init__()
        self.model, self.image_token, self.merge = model, image_token, merge
        self.text_attr = _text_attr(model)
        # the family's own attention masks (Family.attention), else the padding mask
        self.masks = attention(model, image_token) if attention is not None else None
        self.width = model.get_input_embeddings().embedding_dim
        self.register_buffer("zero_row", torch.zeros(1, 1, self.width), persistent=False)
        self.input_roles = {"image_features": contract.IMAGE_FEATURES}
        self.mrope, self.deepstack = mrope is not None, deepstack
        if mrope is not None:
            self.register_buffer("coords", mrope.coords.long(), persistent=False)
            self.input_roles[ROPE_DELTAS] = contract.ROPE_DELTAS

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        image_features: torch.Tensor,
        rope_deltas: torch.Tensor | None = None,
    ) -> torch.Tensor:
        embeds = self.model.get_input_embeddings()(input_ids)
        width, count = self.width, image_features.shape[1]
        index, take = image_slots(input_ids, count, self.image_token, self.merge)
        picked = gather_features(image_features[..., :width], index, self.zero_row)
        embeds = torch.where(take[..., None], picked.to(embeds.dtype), embeds)
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        if self.mrope:
            positions = mrope_positions(
                positions, input_ids, self.image_token, self.coords, rope_deltas
            )
        if self.deepstack:
            layers = [
                gather_features(image_features[..., width * i : width * (i + 1)], index, None)
                for i in range(1, 1 + self.deepstack)
            ]  # each (B, T, hidden), zero away from the image tokens
            return self._deepstack(embeds, attention_mask, positions, take, layers)
        text = getattr(self.model, self.text_attr) if self.text_attr else self.model
        out = text(
            inputs_embeds=embeds,
            attention_mask=self.masks(input_ids, attention_mask) if self.masks else attention_mask,
            position_ids=positions,
            use_cache=False,
            return_dict=True,
        )
        return out.logits

    def _deepstack(self, embeds, attention_mask, positions, take, layers) -> torch.Tensor:
        """The text model with its DeepStack layers adding ``layers`` (dense: zero away from
        the image tokens), in place of Hugging Face's boolean-mask update (a data-dependent
        shape torch.export cannot keep)."""
        text = self.model.model.language_model

        def add(hidden, _mask, visual):
            return hidden + visual.to(hidden.dtype)

        text._deepstack_process = add  # this forward only: removed below
        try:
            out = text(
                inputs_embeds=embeds,
                attention_mask=attention_mask,
                position_ids=positions,
                visual_pos_masks=take,
                deepstack_visual_embeds=layers,
                use_cache=False,
            )
        finally:
            del text._deepstack_process
        return self.model.lm_head(out.last_hidden_state)
