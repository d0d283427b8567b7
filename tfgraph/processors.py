"""A model's own Hugging Face processor (text and images to token ids and pixel tensors),
loaded offline: what a vision-language export's probe (:mod:`tfgraph.sources.vision_language`)
and its runtime (:mod:`tfgraph.runtime.vision_language`) both run, so the graphs are made for
the tensors the runtime later feeds. Imports transformers only when called."""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path

import numpy as np

from tfgraph.errors import TfgraphError, first_line


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
    call = dict(text=list(texts), padding=True, return_tensors=return_tensors, **kwargs)
    try:
        inputs = processor(images=list(images), **call)
    except ValueError:
        if len(images) < 2:
            raise
        # a processor that takes a list of images per text (Mllama's) reads a flat list as
        # one text's images
        inputs = processor(images=[[image] for image in images], **call)
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
