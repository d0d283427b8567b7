"""The modules tfgraph traces a Hugging Face model through: tensors in, logits (or the last
hidden state) out, one subclass per input signature (torch.export needs named forward
arguments), and which one a model's main input takes (:mod:`tfgraph.sources.huggingface`)."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from tfgraph.sources.hf_layouts import NAFLEX_INPUTS


class _HFWrapper(nn.Module):
    """Tensors in, logits (or the last hidden state) out; no cache, no dicts.

    torch.export needs named forward arguments, so each input signature has its subclass.
    """

    input_names: tuple[str, ...] = ()

    def __init__(self, model: nn.Module, output: str = "logits") -> None:
        super().__init__()
        self.model = model
        self.output_names = (output,)
        self._output = output
        params = inspect.signature(model.forward).parameters
        self._no_cache = {"use_cache": False} if "use_cache" in params else {}
        self._positions = "position_ids" in params
        self._masks = "attention_mask" in params

    def _run(self, **kwargs: torch.Tensor):
        return getattr(self.model(**kwargs, **self._no_cache, return_dict=True), self._output)


class _HFTokens(_HFWrapper):
    input_names = ("input_ids",)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._run(input_ids=input_ids)


class _HFTokensMask(_HFWrapper):
    input_names = ("input_ids", "attention_mask")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self._run(input_ids=input_ids, attention_mask=attention_mask)


class _HFCausalLM(_HFWrapper):
    """Positions from the padding mask, as ``generate`` computes them for left padding."""

    input_names = ("input_ids", "attention_mask")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if not self._positions:  # BLOOM: ALiBi from the mask itself
            return self._run(input_ids=input_ids, attention_mask=attention_mask)
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        return self._run(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions)


class _HFSeq2Seq(_HFWrapper):
    """The encoder's mask is stated, all ones: without one, LongT5 and SwitchTransformers
    build their default mask only outside torch.export (``not is_torchdynamo_compiling()``)
    and then fail on ``None``; in eager the two calls are the same."""

    input_names = ("input_ids", "decoder_input_ids")

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        mask = {"attention_mask": torch.ones_like(input_ids)} if self._masks else {}
        return self._run(input_ids=input_ids, decoder_input_ids=decoder_input_ids, **mask)


class _HFSpeechSeq2Seq(_HFWrapper):
    input_names = ("input_features", "decoder_input_ids")

    def forward(
        self, input_features: torch.Tensor, decoder_input_ids: torch.Tensor
    ) -> torch.Tensor:
        return self._run(input_features=input_features, decoder_input_ids=decoder_input_ids)


class _HFAudioSeq2Seq(_HFWrapper):
    input_names = ("input_values", "decoder_input_ids")

    def forward(self, input_values: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        return self._run(input_values=input_values, decoder_input_ids=decoder_input_ids)


class _HFFeatures(_HFWrapper):
    input_names = ("input_features",)

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return self._run(input_features=input_features)


class _HFAudio(_HFWrapper):
    input_names = ("input_values",)

    def forward(self, input_values: torch.Tensor) -> torch.Tensor:
        return self._run(input_values=input_values)


class _HFPixels(_HFWrapper):
    input_names = ("pixel_values",)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self._run(pixel_values=pixel_values)


class _HFPatches(_HFWrapper):
    """Images cut into patches, with their grids and padding (SigLIP 2's NaFlex)."""

    input_names = ("pixel_values", *NAFLEX_INPUTS)

    def forward(
        self,
        pixel_values: torch.Tensor,
        pixel_attention_mask: torch.Tensor,
        spatial_shapes: torch.Tensor,
    ) -> torch.Tensor:
        return self._run(
            pixel_values=pixel_values,
            pixel_attention_mask=pixel_attention_mask,
            spatial_shapes=spatial_shapes,
        )


_ENCODER_ONLY = {
    "input_ids": None,  # _HFTokens or _HFTokensMask
    "input_features": _HFFeatures,
    "input_values": _HFAudio,
    "pixel_values": _HFPixels,
}
_SEQ2SEQ = {
    "input_ids": _HFSeq2Seq,
    "input_features": _HFSpeechSeq2Seq,
    "input_values": _HFAudioSeq2Seq,
}
