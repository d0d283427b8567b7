"""What a tiny image-text-to-text family needs beyond its own classes: :data:`SPECS`, one entry
per ``model_type``, each field with its reason. :func:`spec_for` falls back to
:data:`tfgraph.tools.tiny_vlm_build.DEFAULT_SPEC` (an ``<image>`` token and a prompt that
starts with it), which is all LLaVA-like families need.

Fields (all optional):

- ``tokens``: the tokenizer's named special tokens, read back by the family's processor as
  ``tokenizer.<name>`` (and synced into the config's ``<name>_id``/``<name>_index``);
- ``prompt``: the text, ``{image}`` standing for the processor's image placeholder;
- ``config``: values merged into the tiny config (a nested dict updates a sub-config): the
  ones that must agree with each other or with the 2-layer depth;
- ``processor`` / ``image_processor``: arguments of the family's processor and image
  processor (the image tokens per image, which the processor expands the placeholder to);
- ``nested_images``: the processor takes a list of images per prompt (Mllama);
- ``fill``: ``{name suffix: value}``, parameters set after the random init (Mllama's tanh
  gates, which Hugging Face initialises to zero: a random model would ignore its image).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from tfgraph.tools.tiny_vlm_build import DEFAULT_SPEC, build_family

_QWEN_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}
# the model finds an image by the token after <|vision_start|> (M-RoPE's 3-D positions)
_QWEN_PROMPT = "<|vision_start|>{image}<|vision_end|> w1 w2 w3"
_IDEFICS_TOKENS = {
    "image_token": "<image>",
    "fake_image_token": "<fake_token_around_image>",
    "global_image_token": "<global-img>",
    "end_of_utterance_token": "<end_of_utterance>",
}

# a video family's tokenizer holds its video token too: without it the token's id is <unk>'s,
# which an unknown word of the prompt matches, and the processor counts it as a video token
_VIDEO_TOKENS = {"image_token": "<image>", "video_token": "<video>"}

SPECS: dict[str, dict] = {
    "video_llava": {"tokens": _VIDEO_TOKENS},
    # the processor writes 256 <imgpad> per image (a class default, no processor argument):
    # 64 × 64 patches, which the projector's two stride-2 convolutions pool to 16 × 16
    "got_ocr2": {
        "tokens": {"image_token": "<imgpad>"},
        # (and positions past the 259-token prompt: the tiny text config's are 256)
        "config": {
            "vision_config": {"image_size": 128, "patch_size": 2},
            "text_config": {"max_position_embeddings": 512},
        },
    },
    "llava_next_video": {"tokens": _VIDEO_TOKENS},
    # as a saved BLIP-2 processor: one image token per Q-Former query (the config's 32; without
    # it the processor writes one, and the model merges the first query only), put in front of
    # the text by the processor itself (the text has none), an <image> it adds to the
    # tokenizer as an AddedToken (a tokenizer's own image_token, a string, it cannot use)
    # after the tokenizer's 203 words: the config's image token id
    "blip-2": {
        "tokens": {},
        "processor": {"num_query_tokens": 32},
        "prompt": "w1 w2 w3",
        "config": {"image_token_id": 203},
    },
    # the processor counts an image's features from the base tile's (no default): the tiny
    # SigLIP tower's 4 × 4 patches
    "llava_onevision": {"tokens": _VIDEO_TOKENS, "processor": {"num_image_tokens": 16}},
    # the processor expands <image> to tiles of <|IMG_PATCH|> between its markers (the model's
    # image token: the patch token); a tile of the tiny tower's size, 4 × 4 patches shuffled
    # to 2 × 2 tokens (its defaults: 364-pixel tiles of 28-pixel patches)
    "aya_vision": {
        "tokens": {
            "image_token": "<|IMG_PATCH|>",
            "start_of_img_token": "<|START_OF_IMG|>",
            "end_of_img_token": "<|END_OF_IMG|>",
            "img_line_break_token": "<|IMG_LINE_BREAK|>",
            "tile_token": "TILE",
            "tile_global_token": "TILE_GLOBAL",
        },
        "processor": {"img_size": 32, "downsample_factor": 2},
    },
    # features of 5 tower layers by default (-2, -5, -8, -11, 6 of 24): 2 of the tiny 2-layer
    # tower's 3 hidden states; CLS always dropped (the config states no strategy to derive)
    "vipllava": {
        "config": {"vision_feature_layer": [-2, 0]},
        "processor": {"vision_feature_select_strategy": "default"},
    },
    "qwen2_vl": {"tokens": _QWEN_TOKENS, "prompt": _QWEN_PROMPT},
    "qwen2_5_vl": {
        "tokens": _QWEN_TOKENS,
        "prompt": _QWEN_PROMPT,
        # full attention in the last of the 2 vision blocks (default: blocks 7, 15, 23, 31);
        # windows of 2 × 2 merged patches; the merger's output is the text width
        "config": {
            "vision_config": {
                "fullatt_block_indexes": [1],
                "window_size": 32,
                "out_hidden_size": 64,
            },
        },
    },
    "gemma3": {
        "tokens": {
            "image_token": "<image_soft_token>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
        },
        # 4 × 4 patches pooled to 2 × 2 soft tokens; the processor writes as many
        "config": {"mm_tokens_per_image": 4},
        "processor": {"image_seq_length": 4},
    },
    "paligemma": {
        # the processor reads the image tokens per image off its image processor
        "image_processor": {"image_seq_length": 16},
        "config": {"projection_dim": 64},  # the projector's output: the text width
        "prompt": "{image}w1 w2 w3",
    },
    "mllama": {
        "tokens": {"image_token": "<|image|>"},
        # one global vision layer, features of layer 0 beside the last (7680 = 1280 × 6 by
        # default), a cross-attention layer among the 2 text layers (default: 3, 8, … 38)
        "config": {
            "vision_config": {
                "num_global_layers": 1,
                "intermediate_layers_indices": [0],
                "vision_output_dim": 128,
                "attention_heads": 4,
            },
            "text_config": {"cross_attention_layers": [1]},
        },
        "nested_images": True,
        # the cross-attention layers' and the vision model's tanh gates, zero at init
        "fill": {"gate": 0.8},
    },
    # image_seq_len = (image_size / patch_size)² / scale_factor² = (32 / 8)² / 4
    "idefics3": {"tokens": _IDEFICS_TOKENS, "processor": {"image_seq_len": 4}},
    "smolvlm": {"tokens": _IDEFICS_TOKENS, "processor": {"image_seq_len": 4}},
    # below: the processor is made, the tiny model still fails eagerly (COVERAGE.md says why)
    # the processor checks the placeholder is wrapped in its start and end tokens
    "hunyuan_vl": {"prompt": "{image_start_token}{image}{image_end_token} w1 w2 w3"},
    # the user writes <image>; the processor expands it to its context tokens
    "qianfan_ocr": {"prompt": "<image> w1 w2 w3"},
    # the processors place the image tokens themselves: the text has none
    "florence2": {"prompt": "w1 w2 w3"},
    "fuyu": {
        "tokens": {"image_token": "|SPEAKER|", "image_newline_token": "|NEWLINE|"},
        "prompt": "w1 w2 w3",
    },
    # Qwen2-VL-like processors of video families: their video token in the tokenizer (a word
    # unknown to it is <unk>, which the processor would count as a video token)
    **dict.fromkeys(
        (
            "exaone4_5",
            "hyperclovax_vision_v2",
            "lfm3_vl",
            "video_llama_3",
            "cosmos3_edge",
            "hy_v4_vl",
        ),
        {"tokens": {"image_token": "<image>", "video_token": "<|video_pad|>"}},
    ),
}

# the acceptance list of issue 47, in its order
ACCEPTANCE = (
    "llava",
    "qwen2_vl",
    "qwen2_5_vl",
    "gemma3",
    "idefics3",
    "smolvlm",
    "paligemma",
    "mllama",
)


def spec_for(model_type: str) -> dict:
    """The family's spec over :data:`DEFAULT_SPEC` (its fields replace the default's)."""
    return {**DEFAULT_SPEC, **SPECS.get(model_type, {})}


# built and run eagerly by the slow tier's sweep (SmolVLM's processor needs num2words)
VERIFIED = ACCEPTANCE


def _build(model_type: str, directory: Path) -> None:
    build_family(model_type, directory, spec_for(model_type))


def generic_builders(model_types=None) -> dict:
    """``{model_type: builder(directory)}`` for :data:`tfgraph.tools.tiny_vlm.BUILDERS`: the
    generic build of each family of :data:`VERIFIED` (or ``model_types``)."""
    names = model_types or VERIFIED
    return {m: partial(_build, m) for m in names}
