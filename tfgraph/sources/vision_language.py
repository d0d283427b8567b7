"""Vision-language models (image in, tokens out) from a Hugging Face directory, as the two
sources a runtime needs (docs/vision-language.md):

- **vision**: ``pixel_values`` (batch, channels, height, width) → ``image_features`` (batch,
  image tokens, text hidden size): the vision tower, the family's feature selection and the
  projector; one image per row, run once per prompt;
- **decoder**: ``input_ids``, ``attention_mask``, ``image_features`` → ``logits``, the text
  model with the merge in front: token ``k`` of a row that is the image token takes that row's
  feature ``k``, every other token its embedding (Hugging Face's ``masked_scatter`` for one
  image per row). Exported with ``--kv-cache`` like any decoder: its main input stays token ids.

Why the merge is folded into the decoder rather than a third ``embed`` graph: the decoder keeps
token ids as its main input, so the KV cache pass, parity, the cached runtime, int4 embedding
tables and every runner drive it as any text decoder; a decoding step is one session run, not
an embedding run and a decoder run; and the merge is a Gather and a Where (nothing to reuse
apart). Features are read at the prompt only: a step after it is fed an empty
(batch, 0, hidden) ``image_features`` (:class:`tfgraph.runtime.CachedDecoder`), so a generated
image token is embedded, as Hugging Face's ``generate`` does (pixels at the first step only).

A family is one :class:`Family` entry in :data:`FAMILIES`, keyed by ``model_type``; a VLM of
another family goes the old way (its text decoder alone, :mod:`.huggingface`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tfgraph import contract
from tfgraph.errors import TfgraphError, first_line
from tfgraph.sources.model import ModelSource, max_positions

logger = logging.getLogger(__name__)

PROMPT_IMAGE_TOKENS = 2  # image tokens per row of the parity inputs (VisionLanguage._decoder)


@dataclass(frozen=True)
class Family:
    """What differs between families. ``features(model, pixel_values)``: (batch, image
    tokens, hidden) for one image per row."""

    features: Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _llava_features(model: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """LLaVA: the vision tower's hidden states at ``vision_feature_layer`` (several: joined),
    CLS dropped by the ``default`` strategy, through the projector: transformers'
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


FAMILIES: dict[str, Family] = {"llava": Family(_llava_features)}


def is_vision_language(model) -> bool:
    """A Hugging Face directory of a family tfgraph exports whole: its config.json has a
    ``vision_config`` and a ``model_type`` in :data:`FAMILIES`, and its class is one of
    transformers' image-text-to-text models."""
    if not isinstance(model, (str, Path)) or not (Path(model) / "config.json").is_file():
        return False
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False  # the Hugging Face source says why
    if not isinstance(config, dict) or "vision_config" not in config:
        return False
    if config.get("model_type") not in FAMILIES:
        return False
    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as MAPPING,
        )
    except ImportError:
        return False
    return (config.get("architectures") or [None])[0] in set(MAPPING.values())


class VisionFeatures(nn.Module):
    """``pixel_values`` → ``image_features`` (the vision graph)."""

    input_roles = {"pixel_values": contract.PIXEL_VALUES}
    output_roles = {"image_features": contract.IMAGE_FEATURES}

    def __init__(self, model: nn.Module, family: Family) -> None:
        super().__init__()
        self.model, self.family = model, family

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.family.features(self.model, pixel_values)


def merge_image_features(
    embeds: torch.Tensor,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    image_token: int,
    zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """``embeds`` (B, T, H) with the k-th token of each row's image block replaced by
    ``features[b, k]`` (B, N, H); image tokens past the N-th (or all, when N is 0) keep their
    embedding. A row's image tokens are one block, as the processor writes them: its k-th token
    is the one k positions after the first. (Not a CumSum over the tokens: the KV cache pass
    reads a count of the ids as positions that continue past the cache.) ``zero``: a (1, 1, H)
    zero row, a weight of the module (a zero tensor made in the graph is a ConstantOfShape whose
    fp32 value ``--precision fp16`` does not convert)."""
    is_image = input_ids == image_token  # (B, T)
    first = is_image.float().argmax(-1, keepdim=True)  # (B, 1): the block's first position
    index = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :] - first + 1
    take = is_image & (index >= 1) & (index <= features.shape[1])  # (B, T), index 1 … N
    index = torch.where(take, index, torch.zeros_like(index))  # row 0 of the padded features
    if zero is None:
        zero = features.new_zeros(1, 1, features.shape[2])
    padded = torch.cat([zero.expand(features.shape[0], -1, -1), features], 1)  # (B, 1 + N, H)
    picked = torch.gather(padded, 1, index[..., None].expand(-1, -1, features.shape[2]))
    return torch.where(take[..., None], picked.to(embeds.dtype), embeds)  # (B, T, H)


class MergedDecoder(nn.Module):
    """``input_ids``, ``attention_mask``, ``image_features`` → ``logits`` (the decoder graph):
    the merge, then the text model on the embeddings; positions from the padding mask, as
    ``generate`` computes them for left padding."""

    input_roles = {"image_features": contract.IMAGE_FEATURES}

    def __init__(self, model: nn.Module, image_token: int) -> None:
        super().__init__()
        self.model, self.image_token = model, image_token
        width = model.get_input_embeddings().embedding_dim
        self.register_buffer("zero_row", torch.zeros(1, 1, width), persistent=False)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_features: torch.Tensor
    ) -> torch.Tensor:
        embeds = self.model.get_input_embeddings()(input_ids)
        embeds = merge_image_features(
            embeds, input_ids, image_features, self.image_token, self.zero_row
        )
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        out = self.model(
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=False,
            return_dict=True,
        )
        return out.logits


class VisionLanguage:
    """A loaded VLM: its :attr:`vision` and :attr:`decoder` sources, the image token, the
    processor's settings (``preprocessor_config.json``) and files."""

    def __init__(self, model: nn.Module, path: Path) -> None:
        config = model.config
        self.model, self.path = model, path
        self.model_type = config.model_type
        self.family = FAMILIES[self.model_type]
        self.image_token_id = _image_token(config)
        self.channels, self.image_size = _image_shape(config)
        with torch.no_grad():  # the features' shape: one eager run of the tower on one image
            probe = torch.zeros(1, self.channels, *self.image_size)
            shape = self.family.features(model, probe).shape
        self.image_tokens, self.hidden = int(shape[1]), int(shape[2])
        self.vision = self._vision()
        self.decoder = self._decoder()

    def _info(self, graph: str) -> dict:
        return {
            "model_type": self.model_type,
            "hf_architecture": type(self.model).__name__,
            "graph": graph,
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
        }

    def _vision(self) -> ModelSource:
        def make(batch, _seq, generator):
            shape = (batch, self.channels, *self.image_size)
            return {"pixel_values": torch.randn(shape, generator=generator)}

        module = VisionFeatures(self.model, self.family).eval()
        axes = {"pixel_values": {0: "batch"}}
        origin = f"{ORIGIN}:{self.path}#vision"
        source = ModelSource(module, ("pixel_values",), ("image_features",), axes, make, origin)
        source.info.update(self._info("vision"), main_input="pixel_values")
        return source

    def _decoder(self) -> ModelSource:
        """The decoder's source. Its parity inputs put :data:`PROMPT_IMAGE_TOKENS` image tokens
        at each row's first real positions, inside the prompt that cache parity runs first (a
        later step's features are empty, by design), the other ids never the image token."""
        vocab = self.model.get_input_embeddings().num_embeddings
        scale = float(self.model.get_input_embeddings().weight.detach().std())
        image, n = self.image_token_id, self.image_tokens

        def make(batch, seq, generator):
            ids = torch.randint(0, vocab, (batch, seq), generator=generator)
            ids = torch.where(ids == image, (image + 1) % vocab, ids)
            mask = torch.ones(batch, seq, dtype=torch.int64)
            mask[1:, : seq // 3] = 0  # rows after the first left-padded, as for any causal LM
            for row in range(batch):
                start = 0 if row == 0 else seq // 3
                ids[row, start : start + min(PROMPT_IMAGE_TOKENS, n)] = image
            features = torch.randn(batch, n, self.hidden, generator=generator) * scale
            return {"input_ids": ids, "attention_mask": mask, "image_features": features}

        module = MergedDecoder(self.model, image).eval()
        names = ("input_ids", "attention_mask", "image_features")
        axes = {
            "input_ids": {0: "batch", 1: "sequence"},
            "attention_mask": {0: "batch", 1: "sequence"},
            "image_features": {0: "batch", 1: "image_tokens"},
        }
        origin = f"{ORIGIN}:{self.path}#decoder"
        source = ModelSource(module, names, ("logits",), axes, make, origin)
        source.info.update(self._info("decoder"), main_input="input_ids", causal_lm=True)
        limit = max_positions(self.model.config)
        if limit is not None:
            source.info["max_positions"] = limit
        return source

    def settings(self) -> dict:
        """The manifest's ``vision_language`` entry: the graphs' shapes, the image token, and
        the image processor's own settings (fixed size, tiling, patch lists: as saved)."""
        processor = image_processor_settings(self.path)
        return {
            "model_type": self.model_type,
            "image_token_id": self.image_token_id,
            "image_tokens": self.image_tokens,
            "image_size": list(self.image_size),
            "channels": self.channels,
            "resolution": "fixed",  # the vision graph takes image_size; the processor resizes
            "image_processor": processor,
        }


def image_processor_settings(path: Path) -> dict | None:
    """The image processor's settings as the directory saved them: ``preprocessor_config.json``
    (transformers 4), else the ``image_processor`` of ``processor_config.json`` (5); None
    when it has neither."""
    found = _read_json(path / "preprocessor_config.json")
    if found is None:
        found = (_read_json(path / "processor_config.json") or {}).get("image_processor")
    return found if isinstance(found, dict) else None


def _image_token(config) -> int:
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise TfgraphError(
        f"{config.model_type}: its config states no image_token_id; add it to config.json"
    )


def _image_shape(config) -> tuple[int, tuple[int, int]]:
    vision = config.vision_config
    size = vision.image_size
    size = (size, size) if isinstance(size, int) else tuple(size)
    return getattr(vision, "num_channels", 3) or 3, size


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TfgraphError(f"cannot read '{path}': {exc}") from exc


ORIGIN = "vision-language"  # a graph's origin: vision-language:PATH#vision, …#decoder


def graph_source(spec: str, **loading) -> ModelSource:
    """The source of one graph of a vision-language artifact, from the ``PATH#graph`` its
    report names (``python -m tfgraph parity`` re-checks the graph against it)."""
    path, _, graph = spec.rpartition("#")
    if graph not in ("vision", "decoder"):
        raise TfgraphError(f"'{spec}' names no graph of a vision-language model; export it again")
    vlm = load_vision_language(path, **loading)
    return vlm.vision if graph == "vision" else vlm.decoder


def load_vision_language(
    path: str | Path, *, trust_remote_code: bool = False, attn_implementation: str | None = None
) -> VisionLanguage:
    """The VLM in the Hugging Face directory ``path``, loaded whole in fp32."""
    from tfgraph.sources.huggingface import _load_hf_weights, _refuse_remote_code

    path = Path(path)
    _refuse_remote_code(path, trust_remote_code)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # a config transformers cannot read is the user's input
        raise TfgraphError(f"cannot read '{path / 'config.json'}': {first_line(exc)}") from exc
    cls = getattr(transformers, config.architectures[0])
    model = _load_hf_weights(cls, path, trust_remote_code, attn_implementation, {})
    logger.info("vision-language %s: vision and decoder graphs", config.model_type)
    return VisionLanguage(model, path)
