"""Vision-language models (image in, tokens out) from a Hugging Face directory, as the two
sources a runtime needs (docs/vision-language.md):

- **vision**: the family's vision inputs (``pixel_values``, and what else its processor writes
  per image) → ``image_features`` (images, image tokens, text hidden size): the vision tower,
  the family's feature selection and the projector;
- **decoder**: ``input_ids``, ``attention_mask``, ``image_features`` (and ``rope_deltas`` for
  M-RoPE) → ``logits``, the text model with the merge in front (:mod:`.vlm_graphs`).
  Exported with ``--kv-cache`` like any decoder: its main input stays token ids.

Why the merge is folded into the decoder rather than a third ``embed`` graph: the decoder keeps
token ids as its main input, so the KV cache pass, parity, the cached runtime, int4 embedding
tables and every runner drive it as any text decoder; a decoding step is one session run, not
an embedding run and a decoder run; and the merge is a Gather and a Where (nothing to reuse
apart). Features are read at the prompt only: a step after it is fed an empty
(batch, 0, hidden) ``image_features`` (:class:`tfgraph.runtime.CachedDecoder`), so a generated
image token is embedded, as Hugging Face's ``generate`` does (pixels at the first step only).

A family is one entry of :data:`tfgraph.sources.vlm_families.FAMILIES`, keyed by
``model_type``; a VLM of another family goes the old way (its text decoder alone,
:mod:`.huggingface`). Its shapes are read off a *probe*: the directory's own processor on one
image at the export's input size (:func:`probe`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from tfgraph.errors import TfgraphError, first_line
from tfgraph.sources.model import ModelSource, max_positions
from tfgraph.sources.vlm_families import FAMILIES
from tfgraph.sources.vlm_families.family import Probe
from tfgraph.sources.vlm_graphs import ROPE_DELTAS, MergedDecoder, VisionFeatures

logger = logging.getLogger(__name__)

PROMPT_IMAGE_TOKENS = 2  # image tokens per row of the parity inputs (VisionLanguage._decoder)
DEFAULT_INPUT_SIZE = (448, 448)  # a sized family's image size when neither user nor config says


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


class VisionLanguage:
    """A loaded VLM: its :attr:`vision` and :attr:`decoder` sources, the image token, the
    probe and the processor's settings."""

    def __init__(self, model: nn.Module, path: Path, image_size=None) -> None:
        config = model.config
        self.model, self.path = model, path
        self.model_type = config.model_type
        self.family = FAMILIES[self.model_type]
        self.image_token_id = _image_token(config)
        self.probe = probe(path, model, self.family, image_size)
        self.vision_module = VisionFeatures(model, self.family, self.probe).eval()
        with torch.no_grad():  # the features' shape: one eager run of the tower on the probe
            shape = self.vision_module(*self._vision_values()).shape
        self.image_tokens, self.hidden = int(shape[1]), int(shape[2])
        self.mrope = self.family.mrope(model, self.probe) if self.family.mrope else None
        if self.mrope is not None and self.mrope.coords.shape[0] != self.image_tokens:
            raise TfgraphError(
                f"{self.model_type}: M-RoPE names {self.mrope.coords.shape[0]} image positions "
                f"but the vision graph gives {self.image_tokens} features"
            )
        self.vision = self._vision()
        self.decoder = self._decoder()

    def _vision_values(self) -> list[torch.Tensor]:
        return [self.probe.inputs[n] for n in self.family.vision_inputs]

    def _size_tag(self) -> str:
        """``@HxW`` in a graph's origin when the export chose the input size (``parity``
        re-loads the graph at it)."""
        size = self.probe.input_size
        return f"@{size[0]}x{size[1]}" if (size and self.family.sized) else ""

    def _info(self, graph: str) -> dict:
        return {
            "model_type": self.model_type,
            "hf_architecture": type(self.model).__name__,
            "graph": graph,
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
        }

    def _vision(self) -> ModelSource:
        names, batched = self.family.vision_inputs, self.family.batched

        def make(batch, _seq, generator):
            values = {}
            for name, value in zip(names, self._vision_values(), strict=True):
                if batched:  # the probe's one image repeated to the batch
                    value = value.expand(batch, *value.shape[1:]).clone()
                if value.is_floating_point():
                    value = torch.randn(value.shape, generator=generator).to(value.dtype)
                values[name] = value
            return values

        axes = {n: {0: "batch"} for n in names} if batched else {n: {} for n in names}
        origin = f"{ORIGIN}:{self.path}#vision{self._size_tag()}"
        source = ModelSource(self.vision_module, names, ("image_features",), axes, make, origin)
        source.info.update(self._info("vision"), main_input="pixel_values")
        return source

    def _decoder(self) -> ModelSource:
        """The decoder's source. Its parity inputs put :data:`PROMPT_IMAGE_TOKENS` image tokens
        at each row's first real positions, inside the prompt that cache parity runs first (a
        later step's features are empty, by design), the other ids never the image token."""
        vocab = self.model.get_input_embeddings().num_embeddings
        scale = embedding_scale(self.model)
        image, n = self.image_token_id, self.image_tokens
        module = self.decoder_module(self.model)
        # a cross-attention family's per-row inputs besides the features (Mllama's tiles)
        rows = _row_inputs(module)

        def make(batch, seq, generator):
            ids = torch.randint(0, vocab, (batch, seq), generator=generator)
            ids = torch.where(ids == image, (image + 1) % vocab, ids)
            mask = torch.ones(batch, seq, dtype=torch.int64)
            mask[1:, : seq // 3] = 0  # rows after the first left-padded, as for any causal LM
            for row in range(batch):
                start = 0 if row == 0 else seq // 3
                ids[row, start : start + min(PROMPT_IMAGE_TOKENS, n)] = image
            features = torch.randn(batch, n, self.hidden, generator=generator) * scale
            feeds = {"input_ids": ids, "attention_mask": mask, "image_features": features}
            if self.mrope is not None:
                feeds[ROPE_DELTAS] = torch.randint(-4, 4, (batch, 1), generator=generator)
            for name, (_, example) in rows.items():  # the probe's row, repeated
                feeds[name] = example.expand(batch, *example.shape[1:]).clone()
            return feeds

        names = ("input_ids", "attention_mask", "image_features", *rows)
        axes = {
            "input_ids": {0: "batch", 1: "sequence"},
            "attention_mask": {0: "batch", 1: "sequence"},
            "image_features": {0: "batch", 1: "image_tokens"},
        }
        if self.mrope is not None:
            names += (ROPE_DELTAS,)
            axes[ROPE_DELTAS] = {0: "batch"}
        axes.update({name: {0: "batch"} for name in rows})
        origin = f"{ORIGIN}:{self.path}#decoder{self._size_tag()}"
        source = ModelSource(module, names, ("logits",), axes, make, origin)
        source.info.update(self._info("decoder"), main_input="input_ids", causal_lm=True)
        limit = max_positions(self.model.config)
        if limit is not None:
            source.info["max_positions"] = limit
        return source

    def decoder_module(self, model: nn.Module) -> nn.Module:
        """The decoder graph's module around ``model`` (this VLM's, or the same model built
        without weights that a streamed checkpoint traces: :mod:`.vlm_streamed`): the
        family's own where its text model reads the image by cross-attention (Mllama)."""
        own = getattr(self.family, "decoder", None)
        if own is not None:
            return own(model, self.image_token_id, self.probe).eval()
        # the tokens the features replace: the image token, and the family's around it
        around = self.family.around(model) if self.family.around else ()
        merged = (self.image_token_id, *around) if around else self.image_token_id
        merge, attention = self.family.merge, self.family.attention
        return MergedDecoder(model, merged, merge, self.mrope, attention=attention).eval()

    def settings(self) -> dict:
        """The manifest's ``vision_language`` entry: the graphs' inputs and shapes, the image
        token, and the image processor's own settings (fixed size, tiling, patch lists: as
        saved)."""
        processor = image_processor_settings(self.path)
        first = self.probe.inputs[self.family.vision_inputs[0]]
        size = self.probe.input_size
        return {
            "model_type": self.model_type,
            "image_token_id": self.image_token_id,
            "image_tokens": self.image_tokens,
            "vision_inputs": list(self.family.vision_inputs),
            "batched": self.family.batched,
            "pixel_shape": list(first.shape[1:] if self.family.batched else first.shape),
            # the processor's output shapes follow the image's size: images are resized to
            # input_size first (null: the processor resizes every image to one size itself)
            "input_size": list(size) if (size and self.family.sized) else None,
            "resolution": "fixed",
            "merge": self.family.merge,
            "mrope_delta": self.mrope.delta if self.mrope is not None else None,
            # the decoder's per-row inputs, each the processor's tensor of that name (Mllama)
            "row_inputs": {n: p for n, (p, _) in _row_inputs(self.decoder.module).items()},
            "image_processor": processor,
        }


def embedding_scale(model: nn.Module) -> float:
    """The token embeddings' standard deviation (the parity inputs' image features are drawn
    at it): the table's, or, where the table is not in memory (a streamed checkpoint's, on the
    meta device), that of its first rows as the module reads them."""
    table = model.get_input_embeddings()
    weight = getattr(table, "weight", None)
    if weight is not None and not weight.is_meta:
        return float(weight.detach().std())
    with torch.no_grad():
        rows = table(torch.arange(min(4096, table.num_embeddings)))
    return float(rows.float().std())


def probe(path: Path, model: nn.Module, family, image_size=None) -> Probe:
    """The directory's processor on one image of the export's input size (``image_size``,
    else the vision config's, else :data:`DEFAULT_INPUT_SIZE`) and a prompt holding the image
    token; without a saved processor, ``pixel_values`` zeros at the tower's own size (a
    family whose graph needs more than the pixels then says so)."""
    from tfgraph.processors import load_processor, prompt_tensors

    size = _input_size(model.config, image_size)
    if image_processor_settings(path) is None:
        if family.vision_inputs != ("pixel_values",) or not family.batched:
            raise TfgraphError(
                f"'{path}' has no image processor, and a {model.config.model_type} vision "
                "graph's inputs are what its processor writes; save the model's processor "
                "beside it: processor.save_pretrained(DIR)"
            )
        channels = getattr(model.config.vision_config, "num_channels", 3) or 3
        return Probe({"pixel_values": torch.zeros(1, channels, *size)}, None)
    processor = load_processor(path, folder=None)
    import numpy as np
    from PIL import Image

    image = Image.fromarray(np.full((*size, 3), 127, np.uint8))
    inputs = prompt_tensors(processor, image)
    missing = [n for n in family.vision_inputs if n not in inputs]
    if missing:
        raise TfgraphError(
            f"{model.config.model_type}: the processor in '{path}' writes no '{missing[0]}'; "
            "save the family's own processor beside the model"
        )
    return Probe(inputs, size)


def _input_size(config, image_size) -> tuple[int, int]:
    if image_size:
        return tuple(int(v) for v in image_size)
    size = getattr(getattr(config, "vision_config", None), "image_size", None)
    if isinstance(size, int):
        return (size, size)
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return tuple(int(v) for v in size)
    return DEFAULT_INPUT_SIZE


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


def _row_inputs(module: nn.Module) -> dict:
    """A decoder module's per-row inputs: {input: (the processor's tensor, example row)}."""
    return getattr(module, "row_inputs", {})


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
    graph, _, size = graph.partition("@")
    if size:
        loading["image_size"] = tuple(int(v) for v in size.split("x"))
    if graph not in ("vision", "decoder"):
        raise TfgraphError(f"'{spec}' names no graph of a vision-language model; export it again")
    vlm = load_vision_language(path, **loading)
    return vlm.vision if graph == "vision" else vlm.decoder


def load_vision_language(
    path: str | Path,
    *,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    image_size=None,
) -> VisionLanguage:
    """The VLM in the Hugging Face directory ``path``: streamed from its safetensors shards
    (:mod:`.vlm_streamed`), else loaded whole in fp32."""
    from tfgraph.sources.checkpoint import Checkpoint, whole_load_info
    from tfgraph.sources.huggingface import _has_experts, _load_hf_weights, _refuse_remote_code
    from tfgraph.sources.vlm_streamed import streamed_vision_language

    path = Path(path)
    _refuse_remote_code(path, trust_remote_code)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # a config transformers cannot read is the user's input
        raise TfgraphError(f"cannot read '{path / 'config.json'}': {first_line(exc)}") from exc
    cls = getattr(transformers, config.architectures[0])
    # a mixture-of-experts text model (HY-V4-VL): the experts that trace, as for a decoder
    experts = {"experts_implementation": "batched_mm"} if _has_experts(config) else {}
    logger.info("vision-language %s: vision and decoder graphs", config.model_type)
    why = "no safetensors (pytorch_model.bin)"
    if Checkpoint.present(path):
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        vlm, why = streamed_vision_language(
            VisionLanguage, cls, config, path, {**extra, **experts}, image_size
        )
        if vlm is not None:
            return vlm
    model = _load_hf_weights(cls, path, trust_remote_code, attn_implementation, experts)
    vlm = VisionLanguage(model, path, image_size)
    for source in (vlm.vision, vlm.decoder):
        source.info.update(whole_load_info(path, why))
    return vlm
