"""Tiny random vision-language model directories (no download): a config made small, random
weights, and the family's own processor saved beside them (an image processor at a small image
size, a word-level tokenizer that knows the image token), as ``save_pretrained`` writes a real
checkpoint. Tests and sweeps build them; :data:`BUILDERS` has one entry per ``model_type``, so
a new family is one function.

::

    python -m tfgraph.tools.tiny_vlm llava DIR     # or build("llava", DIR)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from tfgraph.tools.tiny_vlm_families import generic_builders

WORDS = 252  # w0 … w251: ids 3 … 254 after <unk>, <s>, </s>
IMAGE_SIZE, PATCH = 16, 4  # 16 patches: 16 image tokens per image (LLaVA drops CLS)


def word_tokenizer(image_token: str):
    """A transformers fast tokenizer: whitespace-split words ``w0`` … one id each, ``<unk>``
    ``<s>`` ``</s>`` first and ``image_token`` last (id 255: a 256-token vocabulary)."""
    import tokenizers
    import transformers
    from tokenizers import models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(WORDS)] + [image_token]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="</s>", extra_special_tokens={"image_token": image_token},
    )  # fmt: skip
    return fast, len(words) - 1


def _text_config(vocab: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip


def _llava(directory: Path) -> None:
    """LLaVA 1.5's layout: a CLIP vision tower (3 layers; the features of its second-to-last
    layer without CLS, so 2 run), the 2-layer GELU projector, a Llama text model (GQA)."""
    import transformers

    tokenizer, image_id = word_tokenizer("<image>")
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32,
    )  # fmt: skip
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=_text_config(image_id + 1),
        image_token_index=image_id, image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
        vision_feature_layer=-2, vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )  # fmt: skip
    transformers.LlavaForConditionalGeneration(config).eval().save_pretrained(directory)
    images = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = transformers.LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        image_token="<image>",
    )  # fmt: skip
    processor.save_pretrained(directory)


# model_type → writes a tiny random model and its processor into a directory; the other
# families are built generically from their own config and processor classes
# (tiny_vlm_families: Qwen2-VL, Qwen2.5-VL, Gemma 3, Idefics3, SmolVLM, PaliGemma, Mllama)
BUILDERS: dict[str, Callable[[Path], None]] = {"llava": _llava}
BUILDERS.update({k: v for k, v in generic_builders().items() if k not in BUILDERS})


def build(model_type: str, directory: str | Path, seed: int = 0) -> Path:
    """A tiny random ``model_type`` directory at ``directory`` (weights drawn with ``seed``)."""
    import torch

    if model_type not in BUILDERS:
        raise ValueError(f"no tiny builder for '{model_type}' (have: {', '.join(BUILDERS)})")
    directory = Path(directory)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        BUILDERS[model_type](directory)
    return directory


def random_image(path: str | Path, size: int = 24, seed: int = 0) -> Path:
    """A random RGB PNG of ``size`` × ``size`` pixels (the processor resizes it)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return Path(path)


if __name__ == "__main__":
    build(sys.argv[1], sys.argv[2])
