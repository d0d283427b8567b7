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
from tfgraph.runtime.runner import open_runner

logger = logging.getLogger(__name__)


def vision_language(manifest: Mapping | None) -> dict | None:
    """The manifest's ``vision_language`` entry, None for another artifact."""
    return (manifest or {}).get("vision_language")


def load_processor(path: str | Path):
    """The artifact's processor (``processor/``), loaded offline without running code it
    names; a one-line error when it cannot be loaded."""
    directory = Path(path) / "processor"
    if not directory.is_dir():
        raise TfgraphError(f"'{path}' carries no processor/: re-export the vision-language model")
    try:
        import transformers

        return transformers.AutoProcessor.from_pretrained(
            directory, local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:  # files the installed transformers cannot read
        raise TfgraphError(
            f"cannot load the processor in '{directory}' ({first_line(exc)}); it needs "
            "transformers and Pillow: pip install 'tfgraph[hf]' pillow"
        ) from exc


def open_image(image):
    """A PIL image: ``image`` itself, or the file it names (RGB)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    try:
        with Image.open(image) as opened:
            return opened.convert("RGB")
    except (OSError, ValueError) as exc:
        raise TfgraphError(f"cannot read the image '{image}' ({first_line(exc)})") from exc


class ImagePrompts:
    """The prompts of a vision-language artifact: the processor's token ids, and the decoder's
    ``image_features`` from the vision graph (empty, (batch, 0, hidden), without an image)."""

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

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    def prepare(self, texts: Sequence[str], images: Sequence | None) -> tuple[list, dict]:
        """(each row's token ids, ``{"image_features": …}``) for ``texts``, each with the image
        at the same index of ``images`` (or none). A text without the image token gets it in
        front, as the model's prompts have it."""
        if not images:
            ids = [self.tokenizer(t)["input_ids"] for t in texts]
            return ids, self.without_image(len(texts))
        images = list(images) * len(texts) if len(images) == 1 else list(images)
        if len(images) != len(texts):
            raise TfgraphError(
                f"{len(texts)} texts but {len(images)} images: one image, or one per text"
            )
        token = self.processor.image_token
        texts = [t if token in t else f"{token}\n{t}" for t in texts]
        pixels = [open_image(i) for i in images]
        inputs = self.processor(images=pixels, text=list(texts), padding=True, return_tensors="np")
        mask = np.asarray(inputs["attention_mask"]) != 0
        ids = [row[keep].tolist() for row, keep in zip(inputs["input_ids"], mask, strict=True)]
        features = self.vision.run({"pixel_values": np.asarray(inputs["pixel_values"], np.float32)})
        return ids, {"image_features": features[self._features]}

    def without_image(self, batch: int) -> dict[str, np.ndarray]:
        """The decoder's ``image_features`` for prompts without an image: (batch, 0, hidden)."""
        hidden = self.vision.signature.output(contract.IMAGE_FEATURES).shape[-1]
        return {"image_features": np.zeros((batch, 0, hidden), np.float32)}
