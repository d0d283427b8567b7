"""Named model presets: a small dict of configs, and the builders that turn them into modules."""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .gpt import GPT

PRESETS: dict[str, ModelConfig] = {
    "gpt-tiny": ModelConfig(family="decoder", vocab_size=256, d_model=64, n_layers=2, n_heads=4),
    "gpt-tiny-sdpa": ModelConfig(
        family="decoder", vocab_size=256, d_model=64, n_layers=2, n_heads=4, attn_impl="sdpa"
    ),
    "gpt2-small": ModelConfig(
        family="decoder", vocab_size=50257, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024
    ),
}


def build(name_or_config: str | ModelConfig, *, seed: int = 0) -> nn.Module:
    """Build a random-init model in eval mode from a preset name or a config."""
    cfg = PRESETS[name_or_config] if isinstance(name_or_config, str) else name_or_config
    torch.manual_seed(seed)
    return GPT(cfg).eval()


def describe(name: str) -> dict[str, str]:
    """One row of `tfgraph models`: the features a preset is made of."""
    cfg = PRESETS[name]
    if cfg.kv_heads == cfg.n_heads:
        attention = "MHA"
    else:
        attention = "MQA" if cfg.kv_heads == 1 else f"GQA {cfg.n_heads}:{cfg.kv_heads}"
    attention += " causal" if cfg.family == "decoder" else ""
    return {
        "family": cfg.family,
        "attention": f"{attention} ({cfg.attn_impl})",
        "positions": cfg.positions,
        "norm": f"{cfg.norm} {cfg.norm_placement}-LN",
        "ffn": cfg.ffn,
        "size": f"L={cfg.n_layers} d={cfg.d_model} h={cfg.n_heads}",
    }
