"""Position-wise feed-forward networks: plain ``W_2 act(W_1 x)`` and gated ones."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tfgraph.models.config import ModelConfig

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact: x·Φ(x) with the erf
    "gelu-tanh": functools.partial(F.gelu, approximate="tanh"),  # GPT-2's gelu_new
    "swiglu": F.silu,
    "geglu": functools.partial(F.gelu, approximate="tanh"),  # Flan-T5's gated-gelu
}
GATED = ("swiglu", "geglu")


class FeedForward(nn.Module):
    """``FFN(x) = W_2 act(W_1 x + b_1) + b_2`` (ReLU in the original, GELU in BERT and GPT)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[cfg.ffn]
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)))


class GatedFeedForward(nn.Module):
    """``FFN(x) = W_2(act(W_1 x) ⊙ W_3 x)``: SwiGLU (act = SiLU) or gated GELU."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[cfg.ffn]
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


def make_ffn(cfg: ModelConfig) -> nn.Module:
    return GatedFeedForward(cfg) if cfg.ffn in GATED else FeedForward(cfg)
