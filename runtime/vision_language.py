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

import contextlib
import logging
import weakref
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


def load_processor(path: str | Path, folder: str | None = "processor"):
    """The processor in ``path/folder`` (an artifact's ``processor/``; ``folder`` None: the
    model directory itself), loaded offline without running code it names; a one-line error
    when it cannot be loaded. A processor whose video half needs torchvision (Qwen2-VL's in
    transformers 5) is made without it: images and text only."""
    directory = Path(path) / folder if folder else Path(path)
    if not directory.is_dir():
        raise TfgraphError(f"'{path}' carries no processor/: re-export the vision-language model")
    try:
        import transformers

        try:
            return transformers.AutoProcessor.from_pretrained(
                directory, local_files_only=True, trust_remote_code=False
            )
        except ImportError as exc:
            if "torchvision" not in str(exc).lower():
                raise
            return _images_only(directory)
    except TfgraphError:
        raise
    except Exception as exc:  # files the installed transformers cannot read
        raise TfgraphError(
            f"cannot load the processor in '{directory}' ({first_line(exc)}); it needs "
            "transformers and Pillow: pip install 'tfgraph[hf]' pillow"
        ) from exc


def _images_only(directory: Path):
    """The processor class ``processor_config.json`` names, made from its image processor and
    tokenizer with no video processor (whose class transformers exports only with
    torchvision)."""
    import inspect
    import json

    import transformers

    saved = json.loads((directory / "processor_config.json").read_text())
    cls = getattr(transformers, saved.get("processor_class", ""), None)
    if cls is None:
        raise TfgraphError(f"'{directory}' names no processor class transformers has")
    accepted = inspect.signature(cls.__init__).parameters
    skip = ("image_processor", "video_processor", "tokenizer", "processor_class")
    kwargs = {k: v for k, v in saved.items() if k in accepted and k not in skip}
    image = transformers.AutoImageProcessor.from_pretrained(directory, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    with any_video_processor():
        return cls(image_processor=image, tokenizer=tokenizer, video_processor=None, **kwargs)


@contextlib.contextmanager
def any_video_processor():
    """transformers 5.25 checks a processor's ``video_processor`` against a class it exports
    only with torchvision installed, so a Qwen2-VL processor cannot be made without
    torchvision even for images; while the processor is made, that one check accepts any
    video processor (the class's own check is restored at once)."""
    from transformers.processing_utils import ProcessorMixin

    original = ProcessorMixin.check_argument_for_proper_class

    def check(self, argument_name, argument):
        if argument_name == "video_processor":
            return type(argument)
        return original(self, argument_name, argument)

    ProcessorMixin.check_argument_for_proper_class = check
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = original


def _placeholder(processor, token: str, image) -> str:
    """The image placeholder put in front of a text that has none: the image token, wrapped
    in the processor's image start and end tokens where its input check asks for them
    (HunYuan-VL's processor refuses a bare one)."""
    start, end = (getattr(processor, f"image_{n}_token", None) for n in ("start", "end"))
    check = getattr(processor, "validate_inputs", None)
    if not (isinstance(start, str) and isinstance(end, str) and callable(check)):
        return token
    try:
        check(images=[image], text=[token])
    except ValueError:
        return f"{start}{token}{end}"
    return token


def prompt_tensors(processor, images, texts=None, return_tensors: str = "pt") -> dict:
    """``processor(images=…, text=…)`` for one image per text; a text without the image
    token gets it in front, as the model's prompts have it, unless the processor writes the
    image tokens itself (default: the image placeholder alone, a word where the processor
    writes the tokens; not a word beside the placeholder: a tiny word-level tokenizer reads an
    unknown word as an id that may be another special token's). Returns the processor's
    tensors, M-RoPE's ``mm_token_type_ids`` included."""
    images = images if isinstance(images, (list, tuple)) else [images]
    token = image_token_text(processor)
    lead = _placeholder(processor, token, images[0])
    writes = _writes_image_tokens(processor, images[0], token)
    texts = texts if texts is not None else ["hello" if writes else lead] * len(images)
    if not writes:
        texts = [t if token in t else f"{lead}\n{t}" for t in texts]
    kwargs = {}
    if "mm_token_type_ids" in getattr(processor, "model_input_names", ()):
        kwargs["return_mm_token_type_ids"] = True
    inputs = processor(
        images=list(images), text=list(texts), padding=True, return_tensors=return_tensors,
        **kwargs,
    )  # fmt: skip
    return {k: v for k, v in inputs.items() if k != "labels"}


_WRITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _writes_image_tokens(processor, image, token: str) -> bool:
    """Whether the processor writes the image tokens itself for a text without the image
    token (BLIP-2's puts one per Q-Former query in front of the text, so the placeholder is
    not added); a processor that refuses such a text does not. Asked once per processor."""
    if processor not in _WRITES:
        try:
            ids = processor(images=[image], text=["hello"], return_tensors="np")["input_ids"]
            token_id = processor.tokenizer.convert_tokens_to_ids(token)
            _WRITES[processor] = bool((np.asarray(ids) == token_id).any())
        except Exception:  # the processor wants the placeholder in the text
            _WRITES[processor] = False
    return _WRITES[processor]


def image_token_text(processor) -> str:
    """The image placeholder's text: the processor's ``image_token``, else its tokenizer's
    (PP-Chart2Table's processor is the generic one and names none)."""
    token = getattr(processor, "image_token", None)
    token = token or getattr(getattr(processor, "tokenizer", None), "image_token", None)
    token = getattr(token, "content", token)  # BLIP-2's is an AddedToken
    if not isinstance(token, str) or not token:
        raise TfgraphError(
            f"{type(processor).__name__} names no image token (image_token); save a processor "
            "or tokenizer that states it"
        )
    return token


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
        return ids, {**extra, **self._deltas(ids)}

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
        hidden = self.vision.signature.output(contract.IMAGE_FEATURES).shape[-1]
        feeds = {"image_features": np.zeros((batch, 0, hidden), np.float32)}
        if self.settings.get("mrope_delta") is not None:
            feeds["rope_deltas"] = np.zeros((batch, 1), np.int64)
        return feeds
