"""Generation with a vision-language artifact (``export`` of a VLM directory:
docs/vision-language.md): the model's own processor (``processor/``, loaded with
``AutoProcessor``) turns text and an image into token ids and ``pixel_values``; the vision
graph turns the pixels into ``image_features`` once per prompt; the decoder merges them at the
image-token positions of the prompt and decodes with its KV cache (:mod:`.generate`).

::

    images = ImagePrompts("out")
    prompts, extra = images.prepare(["w1 w2"], [Image.open("cat.png")])
    generate(CachedDecoder(open_runner("out")), prompts, config, extra=extra)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from tfgraph import contract
from tfgraph.errors import TfgraphError, first_line
from tfgraph.exporters.manifest import read_manifest
from tfgraph.processors import load_processor, prompt_tensors
from tfgraph.runtime.runner import open_runner

logger = logging.getLogger(__name__)


def vision_language(manifest: Mapping | None) -> dict | None:
    """The manifest's ``vision_language`` entry, None for another artifact."""
    return (manifest or {}).get("vision_language")


def open_image(image):
    """A PIL image: ``image`` itself, the file it names, or an image file's bytes (a server's
    request), as RGB."""
    import io

    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    name = "of the request" if isinstance(image, bytes) else f"'{image}'"
    try:
        with Image.open(io.BytesIO(image) if isinstance(image, bytes) else image) as opened:
            return opened.convert("RGB")
    except (OSError, ValueError) as exc:
        raise TfgraphError(f"cannot read the image {name} ({first_line(exc)})") from exc


class ImagePrompts:
    """The prompts of a vision-language artifact: the processor's token ids, and the decoder's
    per-prompt inputs: ``image_features`` from the vision graph (empty, (batch, 0, hidden),
    without an image) and, with M-RoPE, ``rope_deltas``."""

    def __init__(self, path: str | Path, *, providers: Sequence[str] | None = None) -> None:
        self.path = Path(path)
        self.settings = vision_language(read_manifest(self.path))
        if self.settings is None:
            raise TfgraphError(
                f"'{self.path}' is not a vision-language artifact (no vision_language in its "
                "manifest); --image needs one exported from a VLM directory"
            )
        vision = self.path / self.settings["graphs"]["vision"]
        self.vision = open_runner(vision, **({"providers": providers} if providers else {}))
        self.processor = load_processor(self.path)
        output = self.vision.signature.output(contract.IMAGE_FEATURES)
        self._features = (output or self.vision.signature.outputs[0]).name
        self.names = self.settings.get("vision_inputs") or ["pixel_values"]

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    def prepare(self, texts: Sequence[str], images: Sequence | None) -> tuple[list, dict]:
        """(each row's token ids, the decoder's per-prompt inputs) for ``texts``, each with
        the image at the same index of ``images`` (or none). A text without the image token
        gets it in front, as the model's prompts have it. Images are resized to the graph's
        input size first where the processor's shapes follow the image's (Qwen2-VL's grid)."""
        if not images:
            ids = [self.tokenizer(t)["input_ids"] for t in texts]
            return ids, self.without_image(len(texts))
        images = list(images) * len(texts) if len(images) == 1 else list(images)
        if len(images) != len(texts):
            raise TfgraphError(
                f"{len(texts)} texts but {len(images)} images: one image, or one per text"
            )
        pixels = [self._sized(open_image(i)) for i in images]
        inputs = prompt_tensors(self.processor, pixels, list(texts), return_tensors="np")
        mask = np.asarray(inputs["attention_mask"]) != 0
        ids = [row[keep].tolist() for row, keep in zip(inputs["input_ids"], mask, strict=True)]
        extra = {"image_features": self._run_vision(inputs, len(texts))}
        return ids, {**extra, **self._deltas(ids), **self._row_inputs(inputs, ids)}

    def _row_inputs(self, inputs: Mapping, ids: list) -> dict[str, np.ndarray]:
        """The decoder's per-row inputs that are the processor's tensors (Mllama's
        ``image_tiles``: its ``aspect_ratio_mask``), one row per prompt, fed at every step;
        PaliGemma's ``prompt_length``: the longest prompt (``generate`` pads every row on the
        left to it, so each row's prompt ends there)."""
        named = self.settings.get("row_inputs") or {}
        longest = np.full((len(ids), 1), max(len(row) for row in ids), np.int64)
        return {
            n: longest
            if p == contract.PROMPT_LENGTH
            else np.asarray(inputs[p]).reshape(len(ids), -1)
            for n, p in named.items()
        }

    def _sized(self, image):
        size = self.settings.get("input_size")
        if not size or tuple(image.size) == (size[1], size[0]):
            return image
        from PIL import Image

        return image.resize((size[1], size[0]), Image.Resampling.BICUBIC)

    def _run_vision(self, inputs: Mapping, rows: int) -> np.ndarray:
        """The features of every row's image: one run, or one per image where the graph takes
        one image (its inputs split evenly: every image has the graph's shapes)."""
        values = {}
        for name in self.names:
            value = np.asarray(inputs[name])
            values[name] = value.astype(np.float32) if value.dtype.kind == "f" else value
        if self.settings.get("batched", True):
            return self.vision.run(values)[self._features]
        expected = self.settings.get("pixel_shape")
        parts = {n: np.split(v, rows) for n, v in values.items()}
        first = parts[self.names[0]][0]
        if expected and list(first.shape) != list(expected):
            raise TfgraphError(
                f"the processor made {list(first.shape)} {self.names[0]} per image but the "
                f"vision graph takes {expected}; re-export with --image-size for this size"
            )
        runs = [
            self.vision.run({n: parts[n][r] for n in self.names})[self._features]
            for r in range(rows)
        ]
        return np.concatenate(runs, 0)

    def _deltas(self, ids: list) -> dict[str, np.ndarray]:
        """M-RoPE's ``rope_deltas``: the manifest's delta for a row holding the image, 0 for
        one without."""
        delta = self.settings.get("mrope_delta")
        if delta is None:
            return {}
        token = self.settings["image_token_id"]
        rows = [[delta if token in row else 0] for row in ids]
        return {"rope_deltas": np.asarray(rows, np.int64)}

    def without_image(self, batch: int) -> dict[str, np.ndarray]:
        """The decoder's per-prompt inputs for prompts without an image: (batch, 0, hidden)
        features, and zero M-RoPE deltas."""
        if self.settings.get("row_inputs"):  # Mllama: cross-attention reads the image
            raise TfgraphError(
                f"a {self.settings.get('model_type')} artifact attends an image from every "
                "prompt (its cross-attention layers); give an image with each text"
            )
        hidden = self.vision.signature.output(contract.IMAGE_FEATURES).shape[-1]
        feeds = {"image_features": np.zeros((batch, 0, hidden), np.float32)}
        if self.settings.get("mrope_delta") is not None:
            feeds["rope_deltas"] = np.zeros((batch, 1), np.int64)
        return feeds
