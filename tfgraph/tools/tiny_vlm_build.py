"""Any image-text-to-text family made tiny, generically: the config from the family's own
config class (:func:`tfgraph.tools.tiny_configs.tiny_config`: 2 layers, width 64, tiny
vision tower), the processor from its own processor class
(:func:`tfgraph.tools.tiny_processors.tiny_processor`), the config's image-token ids set to
the generated tokenizer's, random weights; and the eager check: Hugging Face ``generate`` on
``processor(images=random image, text=prompt)``, greedy, a few tokens.

A family's spec (:data:`tfgraph.tools.tiny_vlm.FAMILIES`, else :data:`DEFAULT_SPEC`) holds
only what cannot be derived: the names and texts of its image tokens, its prompt, config and
processor values that must agree (image tokens per image), and each entry's reason.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

NEW_TOKENS = 4  # the eager check's greedy tokens
IMAGE_HW = (40, 48)  # the random image: not square, not the tower's size (the processor resizes)
DEFAULT_SPEC = {"tokens": {"image_token": "<image>"}, "prompt": "{image} w1 w2 w3"}
# sizes the shared tiny config leaves at their defaults in vision towers (Qwen2-VL's 32-block
# ``depth``), set where the sub-config has them
VISION_TINY = {"depth": 2, "num_hidden_layers": 2, "vision_layers": 2}


def model_class(model_type: str):
    """The family's image-text-to-text class (transformers' auto mapping)."""
    import transformers
    from transformers.models.auto import modeling_auto

    name = modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type]
    if isinstance(name, (tuple, list)):
        name = name[0]
    return getattr(transformers, name)


def tiny_vlm_config(model_type: str, spec: dict):
    """The family's tiny config, its vision tower shallow too, ``spec["config"]`` merged in
    (a nested dict updates a sub-config)."""
    from tfgraph.tools.tiny_configs import tiny_config
    from tfgraph.tools.tiny_processors import grid_pinpoints

    config = tiny_config(model_type)
    data = config.to_dict()
    vision, text = data.get("vision_config"), data.get("text_config")
    if isinstance(vision, dict):
        vision.update({k: v for k, v in VISION_TINY.items() if k in vision})
        if isinstance(text, dict) and "hidden_size" in text:  # the tower's output feeds text
            width, names = text["hidden_size"], ("out_hidden_size", "text_hidden_size")
            vision.update({k: width for k in names if k in vision})
    if data.get("image_grid_pinpoints") and isinstance(vision, dict):
        data["image_grid_pinpoints"] = grid_pinpoints(vision.get("image_size") or 32)
    if isinstance(text, dict) and _takes_mrope(model_type, config):
        _fit_mrope(text)
    _merge(data, spec.get("config", {}))
    return type(config).from_dict(data)


def _takes_mrope(model_type: str, config) -> bool:
    """Whether the text model splits its rotary half by ``mrope_section``: its config class
    lets the key through rope validation, or its modeling code reads it (PaddleOCR-VL)."""
    import inspect
    import sys

    text_class = type(getattr(config, "text_config", None))
    if "mrope_section" in set(getattr(text_class, "ignore_keys_at_rope_validation", None) or ()):
        return True
    try:
        module = sys.modules[model_class(model_type).__module__]
        return '"mrope_section"' in inspect.getsource(module)
    except (OSError, TypeError, KeyError):
        return False


def _fit_mrope(text: dict) -> None:
    """M-RoPE's temporal/height/width split of the rotary half for the tiny head size, where
    the text config takes one (its class lets ``mrope_section`` through rope validation): the
    models' defaults (Qwen2-VL's 16, 24, 24; GLM-4V's 8, 12, 12) split a wider head, so the
    tiny one gets a quarter, three eighths, three eighths (2, 3, 3 of 8)."""
    rope = text.get("rope_parameters")
    heads = text.get("num_attention_heads")
    if not isinstance(rope, dict) or not isinstance(heads, int):
        return
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    rotary = int(head_dim * (rope.get("partial_rotary_factor") or 1.0)) // 2
    first = max(1, rotary // 4)
    second = (rotary - first) // 2
    rope["mrope_section"] = [first, second, rotary - first - second]


def _merge(into: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def build_family(model_type: str, directory: Path, spec: dict | None = None, seed: int = 0):
    """Write a tiny random ``model_type`` directory (config, weights, processor) and return
    ``(model, processor)``."""
    import torch

    from tfgraph.tools.tiny_processors import sync_token_ids, tiny_processor

    spec = spec or DEFAULT_SPEC
    config = tiny_vlm_config(model_type, spec)
    processor = tiny_processor(model_type, config, spec)
    ids = sync_token_ids(config, processor)
    logger.debug("%s: token ids %s", model_type, ids)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(model_type)(config).eval()
    with torch.no_grad():  # spec["fill"]: parameters set after the random init (Mllama's gates)
        for name, parameter in model.named_parameters():
            for suffix, value in spec.get("fill", {}).items():
                if name.endswith(suffix):
                    parameter.fill_(value)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return model, processor


def random_image(seed: int = 0, hw: tuple[int, int] = IMAGE_HW):
    """A random RGB PIL image."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*hw, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def prompt_for(processor, spec: dict | None = None) -> str:
    """The family's prompt: ``{image}`` is the processor's image placeholder (its
    ``image_token``), any other ``{name}`` the processor's attribute of that name
    (HunYuan-VL's ``{image_start_token}``)."""
    spec = spec or DEFAULT_SPEC
    return spec.get("prompt", DEFAULT_SPEC["prompt"]).format_map(_ProcessorTokens(processor))


class _ProcessorTokens(dict):
    """``str.format_map``'s lookup of a prompt's fields on the processor."""

    def __init__(self, processor) -> None:
        super().__init__(image=getattr(processor, "image_token", None) or "<image>")
        self.processor = processor

    def __missing__(self, key: str) -> str:
        value = getattr(self.processor, key, None)
        if not isinstance(value, str):
            raise KeyError(f"the prompt names {{{key}}}, which the processor does not have")
        return value


def processor_inputs(processor, spec: dict | None = None, image=None) -> dict:
    """``processor(images=[image], text=[prompt], return_tensors="pt")`` as the family takes
    it (Mllama wants a list of images per prompt)."""
    spec = spec or DEFAULT_SPEC
    image = image if image is not None else random_image()
    images = [[image]] if spec.get("nested_images") else [image]
    kwargs = {}
    if "mm_token_type_ids" in getattr(processor, "model_input_names", ()):
        # M-RoPE's models need it; Cosmos3-Edge's processor lists it but does not return it
        kwargs["return_mm_token_type_ids"] = True
    text = [prompt_for(processor, spec)]
    inputs = processor(images=images, text=text, return_tensors="pt", **kwargs)
    return {k: v for k, v in inputs.items() if k != "labels"}  # PaliGemma's: training only


def eager_generate(model, processor, spec: dict | None = None, new_tokens: int = NEW_TOKENS):
    """Hugging Face ``generate`` greedy on a random image: ``(inputs, new token ids)``."""
    import torch

    inputs = processor_inputs(processor, spec)
    # set on the model's own config, not passed: BLIP's generate passes pad_token_id itself
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
        )
    # exactly new_tokens were generated: the last ones (BLIP's output has no prompt in front)
    return inputs, out[0, -new_tokens:].tolist()
