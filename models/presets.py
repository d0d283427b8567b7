"""Named model presets: a small dict of configs, and the builders that turn them into modules.

The tiny presets (d_model ≤ 64 except where a head ratio needs more, 2 layers, vocab 256) keep
each architecture's distinguishing features at a size where tests run in milliseconds.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from tfgraph.models.config import ModelConfig
from tfgraph.models.transformer import MODELS


def _sdpa(cfg: ModelConfig) -> ModelConfig:
    return replace(cfg, attn_impl="sdpa")


_GPT = ModelConfig(family="decoder", vocab_size=256, d_model=64, n_layers=2, n_heads=4)
_BERT = ModelConfig(
    family="encoder", norm_placement="post", norm_eps=1e-12, embed_norm=True, ffn="gelu"
)
_LLAMA = ModelConfig(
    positions="rope",
    norm="rmsnorm",
    norm_eps=1e-6,
    ffn="swiglu",
    d_ff=176,  # ≈ 8/3·d_model, as Llama sizes SwiGLU
    n_heads=8,
    n_kv_heads=2,
    bias=False,
    tie_embeddings=False,
)
_MISTRAL = replace(_LLAMA, sliding_window=8)
_MPT = ModelConfig(positions="alibi", n_heads=8, bias=False, ffn="gelu")
_T5 = ModelConfig(
    family="encoder-decoder",
    positions="t5",
    norm="rmsnorm",
    norm_eps=1e-6,
    ffn="relu",
    bias=False,
    scale_scores=False,
)

PRESETS: dict[str, ModelConfig] = {
    "gpt-tiny": _GPT,
    "gpt-tiny-sdpa": _sdpa(_GPT),
    "gpt2-small": ModelConfig(
        family="decoder", vocab_size=50257, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024
    ),
    "gpt2-tiny": replace(_GPT, ffn="gelu-tanh"),
    "transformer-tiny": ModelConfig(
        family="encoder-decoder",
        positions="sinusoidal",
        norm_placement="post",
        ffn="relu",
        embed_scale=True,
    ),
    "bert-tiny": _BERT,
    "bert-tiny-sdpa": _sdpa(_BERT),
    "roberta-tiny": replace(_BERT, position_offset=2, norm_eps=1e-5, num_labels=3),
    "llama-tiny": _LLAMA,
    "llama-tiny-sdpa": _sdpa(_LLAMA),
    "llama2-70b-tiny": replace(_LLAMA, d_model=128, n_heads=64, n_kv_heads=8, d_ff=352),
    "llama-ntk-tiny": replace(_LLAMA, rope_ntk_factor=4.0),
    "mistral-tiny": _MISTRAL,
    "mistral-tiny-sdpa": _sdpa(_MISTRAL),
    "palm-tiny": ModelConfig(
        positions="rope", ffn="swiglu", n_kv_heads=1, parallel_block=True, bias=False
    ),
    "phi-tiny": ModelConfig(
        positions="rope",
        rope_fraction=0.5,
        parallel_block=True,
        ffn="gelu-tanh",
        tie_embeddings=False,
    ),
    "bloom-tiny": ModelConfig(
        positions="alibi", d_model=48, n_heads=6, embed_norm=True, ffn="gelu-tanh"
    ),
    "mpt-tiny": _MPT,
    "mpt-tiny-sdpa": _sdpa(_MPT),
    "t5-tiny": _T5,
    "t5-tiny-sdpa": _sdpa(_T5),
    "flan-t5-tiny": replace(_T5, ffn="geglu", d_ff=128, tie_embeddings=False),
    "bart-tiny": ModelConfig(
        family="encoder-decoder",
        position_offset=2,
        norm_placement="post",
        embed_norm=True,
        ffn="gelu",
    ),
    "shaw-tiny": ModelConfig(positions="shaw", shaw_max_distance=8),
    "seed-layernorm-tiny": replace(_GPT, norm="layernorm-seed"),
}


def _config(name_or_config: str | ModelConfig) -> ModelConfig:
    if isinstance(name_or_config, ModelConfig):
        return name_or_config
    try:
        return PRESETS[name_or_config]
    except KeyError:
        raise KeyError(
            f"unknown preset {name_or_config!r}; known: {', '.join(sorted(PRESETS))}"
        ) from None


def build(name_or_config: str | ModelConfig, *, seed: int = 0) -> nn.Module:
    """Build a random-init model in eval mode; the same seed gives the same weights.

    The global RNG is left as it was (the init draws from a forked generator state).
    """
    cfg = _config(name_or_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MODELS[cfg.family](cfg)
    return model.eval()


def describe(name_or_config: str | ModelConfig) -> dict[str, str]:
    """One row of `tfgraph models`: the features a preset is made of."""
    cfg = _config(name_or_config)
    if cfg.kv_heads == cfg.n_heads:
        attention = "MHA"
    else:
        attention = "MQA" if cfg.kv_heads == 1 else f"GQA {cfg.n_heads}:{cfg.kv_heads}"
    attention += {"decoder": " causal", "encoder": " bidirectional"}.get(
        cfg.family, " bidirectional+causal+cross"
    )
    if cfg.sliding_window is not None:
        attention += f" window={cfg.sliding_window}"
    if not cfg.scale_scores:
        attention += " unscaled"
    positions = {
        "learned": "learned absolute",
        "sinusoidal": "sinusoidal",
        "rope": "RoPE",
        "alibi": "ALiBi",
        "t5": f"T5 relative buckets ({cfg.rel_buckets})",
        "shaw": f"Shaw relative keys (k={cfg.shaw_max_distance})",
        "none": "none",
    }[cfg.positions]
    if cfg.positions == "rope":
        if cfg.rotary_dim != cfg.head_dim:
            positions += f" partial {cfg.rotary_dim}/{cfg.head_dim}"
        if cfg.rope_ntk_factor != 1.0:
            positions += f" NTK×{cfg.rope_ntk_factor:g}"
    head = {"decoder": "LM", "encoder": f"classifier ({cfg.num_labels})"}.get(cfg.family, "LM")
    if cfg.family != "encoder":
        head += " tied" if cfg.tie_embeddings else " untied"
    return {
        "family": cfg.family,
        "attention": f"{attention} ({cfg.attn_impl})",
        "positions": positions,
        "norm": f"{cfg.norm} {cfg.norm_placement}-LN" + (" parallel" if cfg.parallel_block else ""),
        "ffn": cfg.ffn,
        "head": head,
        "size": f"L={cfg.n_layers} d={cfg.d_model} h={cfg.n_heads} vocab={cfg.vocab_size}",
    }
