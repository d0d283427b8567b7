"""Tiny processors for tiny vision-language models: the family's own processor class, its own
image processor made small, and a generated word-level tokenizer that holds the family's
image and special tokens. Nothing is downloaded.

A vision-language model and its processor must agree on three things, which a random tiny
directory would otherwise get wrong:

1. the image tokens' ids: the processor writes them into ``input_ids`` and the model finds
   the image positions by them, so the config's ``image_token_id`` (``image_token_index``,
   ``boi_token_index``, ``vision_start_token_id`` …) is set to the generated tokenizer's id of
   the token of the same name (:func:`sync_token_ids`);
2. the image resolution: the image processor resizes to the tiny vision tower's
   ``image_size`` and patches by its ``patch_size`` (:func:`tiny_image_processor`);
3. the number of image tokens per image, which the processor expands the placeholder to:
   given per family where it is a processor argument (Gemma 3's ``image_seq_length``).

:mod:`tfgraph.tools.tiny_vlm` builds the directories with these.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re

logger = logging.getLogger(__name__)

WORDS = 200  # plain words w0 … w199 after the special and image tokens: well inside 512 ids
BASE_SPECIAL = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
_BACKENDS = ("pil", "torchvision", "slow", "fast")  # PIL first: no torchvision needed


def word_tokenizer(tokens: dict[str, str] | None = None, chat_template: str | None = None):
    """A fast tokenizer over whitespace-split words (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, then
    the named ``tokens`` as special tokens, then ``w0`` …): ``tokens`` maps an attribute name
    to its text (``{"image_token": "<image>"}``), which the family's processor reads back as
    ``tokenizer.image_token`` and ``tokenizer.image_token_id``."""
    import tokenizers
    import transformers
    from tokenizers import models, pre_tokenizers

    tokens = dict(tokens or {})
    words = list(BASE_SPECIAL.values()) + [f"w{i}" for i in range(WORDS)]
    vocab = {w: i for i, w in enumerate(words)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    named = {k: v for k, v in tokens.items() if k not in BASE_SPECIAL and k != "pad_token"}
    # added tokens are split out of the text before the pre-tokenizer: "<image><image>" is two
    tok.add_special_tokens(list(dict.fromkeys(named.values())))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        **BASE_SPECIAL,
        pad_token=tokens.get("pad_token", "<unk>"),
        extra_special_tokens=named,
        chat_template=chat_template,
    )


def tiny_image_processor(model_type: str, vision_config, overrides: dict | None = None):
    """The family's own image processor (its PIL variant where it has one) resized to the tiny
    vision tower: ``size``/``crop_size`` of its ``image_size``, its ``patch_size`` and merge
    size, pixel bounds of a few merged patches for dynamic-resolution processors (Qwen2-VL's
    ``shortest_edge``/``longest_edge`` count pixels); ``overrides`` last."""
    import transformers
    from transformers.models.auto import image_processing_auto

    names = image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type)
    if names is None:
        raise ValueError(f"transformers names no image processor for {model_type!r}")
    if isinstance(names, dict):
        names = [names.get(b) for b in _BACKENDS]
    elif isinstance(names, str):
        names = [names]
    classes = [getattr(transformers, n, None) for n in names if n]
    classes = [c for c in classes if c is not None and not _is_dummy(c)]
    if not classes:
        raise ValueError(f"{model_type}'s image processor needs a backend not installed: {names}")
    default = classes[0]()
    kwargs = _tiny_image_kwargs(default, vision_config)
    kwargs.update(overrides or {})
    return classes[0](**kwargs)


def _is_dummy(cls) -> bool:
    """transformers' placeholder for a class whose backend (torchvision) is missing."""
    return type(cls).__name__ == "DummyObject"


def _tiny_image_kwargs(default, vision_config) -> dict:
    side = int(_first(vision_config, ("image_size",), 32))
    patch = int(_first(vision_config, ("patch_size",), 8))
    merge = int(_first(vision_config, ("spatial_merge_size", "merge_size"), 1))
    size = getattr(default, "size", None)
    keys = {k for k, v in dict(size or {}).items() if v is not None}
    kwargs: dict = {}
    if getattr(default, "patch_size", None) is not None:
        kwargs["patch_size"] = (
            {"height": patch, "width": patch} if _dictish(default.patch_size) else patch
        )
    if getattr(default, "merge_size", None) is not None:
        kwargs["merge_size"] = merge
    if {"shortest_edge", "longest_edge"} <= keys and getattr(default, "patch_size", None):
        unit = (patch * merge) ** 2  # pixels of one merged token
        kwargs["size"] = {"shortest_edge": unit, "longest_edge": unit * 36}
    elif {"shortest_edge", "longest_edge"} <= keys:  # Idefics2: edges in pixels
        kwargs["size"] = {"shortest_edge": side, "longest_edge": side}
    elif "longest_edge" in keys:  # Idefics3/SmolVLM: tiles of image_size, at most 2 × 2
        kwargs["size"] = {"longest_edge": 2 * side}
        if getattr(default, "max_image_size", None) is not None:
            kwargs["max_image_size"] = {"longest_edge": side}
    elif "shortest_edge" in keys:
        kwargs["size"] = {"shortest_edge": side}
    elif keys:
        kwargs["size"] = {"height": side, "width": side}
    if getattr(default, "crop_size", None) is not None:
        kwargs["crop_size"] = {"height": side, "width": side}
    if getattr(default, "image_grid_pinpoints", None):  # LLaVA-NeXT's tilings, in tiles
        kwargs["image_grid_pinpoints"] = grid_pinpoints(side)
    return kwargs


def grid_pinpoints(side: int) -> list[list[int]]:
    """LLaVA-NeXT's resolutions for a tower of ``side`` pixels: 1 × 2, 2 × 1 and 2 × 2 tiles
    (the default's are multiples of 336)."""
    return [[side, 2 * side], [2 * side, side], [2 * side, 2 * side]]


def _dictish(value) -> bool:
    return hasattr(value, "keys") or hasattr(value, "height")


def _first(config, names, fallback):
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return fallback


def tiny_processor(model_type: str, config, spec: dict):
    """The family's processor class over a tiny image processor and a :func:`word_tokenizer`
    holding ``spec["tokens"]``; ``spec["processor"]`` are its own arguments (the image token
    count), ``spec["image_processor"]`` the image processor's overrides. A token the processor
    asks the tokenizer for and the spec does not name (``tokenizer.boi_token``) is added as
    ``<boi_token>`` and the processor made again: most families need no token list."""
    tokens = dict(spec.get("tokens") or {})
    for _ in range(_MAX_DISCOVERED):
        try:
            return _make_processor(model_type, config, {**spec, "tokens": tokens})
        except (AttributeError, ValueError) as exc:
            missing = _missing_token(exc)
            if missing is None or missing in tokens:
                raise
            tokens[missing] = f"<{missing}>"
    return _make_processor(model_type, config, {**spec, "tokens": tokens})


_MAX_DISCOVERED = 8
_MISSING = re.compile(
    r"(?:has no attribute|missing required attribute|does not have an) [`']?"
    r"(?P<name>\w+?_token)(?:_id)?[`']?(?:\W|$)"
)


def _missing_token(exc: Exception) -> str | None:
    match = _MISSING.search(str(exc))
    return match["name"] if match else None


def _make_processor(model_type: str, config, spec: dict):
    import transformers
    from transformers.models.auto import processing_auto

    name = spec.get("processor_class") or processing_auto.PROCESSOR_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, name, None) if name else None
    if cls is None or _is_dummy(cls):
        raise ValueError(f"transformers names no usable processor for {model_type!r} ({name})")
    vision = getattr(config, "vision_config", None) or config
    parts: dict = {}
    for attribute in cls.get_attributes():
        if "tokenizer" in attribute and "protein" not in attribute:  # qformer_tokenizer too
            parts[attribute] = word_tokenizer(spec.get("tokens"), spec.get("chat_template"))
        elif attribute == "image_processor":
            owner = spec.get("image_processor_type") or _image_processor_owner(model_type, name)
            parts[attribute] = tiny_image_processor(owner, vision, spec.get("image_processor"))
        elif attribute == "video_processor":
            from transformers.video_processing_utils import BaseVideoProcessor

            parts[attribute] = BaseVideoProcessor()  # images only: no torchvision needed
        elif attribute == "feature_extractor":
            parts[attribute] = _feature_extractor(model_type)
        else:
            raise ValueError(f"{name} also takes a {attribute}: not built for tiny VLMs yet")
    accepted = inspect.signature(cls.__init__).parameters
    extra = {**_derived_processor_kwargs(config, vision), **spec.get("processor", {})}
    extra = {k: v for k, v in extra.items() if k in accepted}
    from tfgraph.processors import any_video_processor

    with any_video_processor():
        return cls(**parts, **extra)


def _image_processor_owner(model_type: str, processor_name: str) -> str:
    """The model type whose image processor to use: its own, else that of a model type with
    the same processor class (Qwen3-VL-MoE has none of its own, Qwen3-VL's fits)."""
    from transformers.models.auto import image_processing_auto, processing_auto

    names = image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES
    if model_type in names:
        return model_type
    for other, cls in processing_auto.PROCESSOR_MAPPING_NAMES.items():
        if cls == processor_name and other in names:
            return other
    return model_type


def _feature_extractor(model_type: str):
    """The family's audio feature extractor at its defaults (an omni model's processor takes
    one; images never reach it)."""
    import transformers
    from transformers.models.auto import feature_extraction_auto

    name = feature_extraction_auto.FEATURE_EXTRACTOR_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None or _is_dummy(cls):
        raise ValueError(f"transformers names no usable feature extractor for {model_type!r}")
    return cls()


def _derived_processor_kwargs(config, vision) -> dict:
    """Processor arguments that restate the model's config (LLaVA's processor counts image
    tokens from the tower's patch size, whether it keeps CLS, and the feature strategy)."""
    kwargs: dict = {}
    patch = getattr(vision, "patch_size", None)
    if isinstance(patch, int):
        kwargs["patch_size"] = patch
    strategy = getattr(config, "vision_feature_select_strategy", None)
    if isinstance(strategy, str):
        kwargs["vision_feature_select_strategy"] = strategy
    # CLIP's tower prepends a CLS token, SigLIP's does not
    kwargs["num_additional_image_tokens"] = int("clip" in getattr(vision, "model_type", ""))
    return kwargs


_ID_FIELD = re.compile(r"^(?P<name>\w+?)(_id|_index)$")
_KEEP = {"pad_token", "bos_token", "eos_token", "unk_token", "decoder_start_token"}


def sync_token_ids(config, processor) -> dict[str, int]:
    """Set every ``<name>_id``/``<name>_index`` field of the config and its sub-configs to the
    tokenizer's id of the token ``<name>`` (the tokenizer's attribute of that name, else the
    processor's): ``image_token_index`` → ``tokenizer.image_token``'s id. Returns what was
    set, ``{"image_token_index": 4, …}``."""
    tokenizer = processor.tokenizer
    unk = tokenizer.unk_token_id
    configs = [config] + [
        getattr(config, n) for n in getattr(config, "sub_configs", {}) if getattr(config, n, None)
    ]
    done: dict[str, int] = {}
    for cfg in configs:
        for field in list(cfg.to_dict()):
            match = _ID_FIELD.match(field)
            if not match or match["name"] in _KEEP:
                continue
            text = _token_text(match["name"], tokenizer, processor)
            if text is None:
                continue
            token_id = tokenizer.convert_tokens_to_ids(text)
            if isinstance(token_id, int) and token_id != unk:
                setattr(cfg, field, token_id)
                done[field] = token_id
    return done


def _token_text(name: str, tokenizer, processor) -> str | None:
    for owner in (tokenizer, processor):
        with contextlib.suppress(Exception):
            value = getattr(owner, name, None)
            if isinstance(value, str) and value:
                return value
    return None
