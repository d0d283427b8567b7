"""Normalizations, written out by hand as the seeds write them."""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig


class LayerNorm(nn.Module):
    """``γ ⊙ (x − μ)/√(σ² + ε) + β`` over the features of each token (as ``F.layer_norm``)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # γ
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None  # β

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)  # biased variance σ²
        y = (x - mu) * torch.rsqrt(var + self.eps) * self.weight
        return y if self.bias is None else y + self.bias


class SeedLayerNorm(LayerNorm):
    """The seed's variant ``γ ⊙ (x − μ)/(σ + ε) + β``: ε added to the standard deviation σ."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        sigma = (x - mu).pow(2).mean(-1, keepdim=True).sqrt()  # population standard deviation
        y = self.weight * (x - mu) / (sigma + self.eps)
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    """``x · rsqrt(mean(x²) + ε) · γ``, computed in fp32 as Llama and T5 do."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # γ

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    cls = SeedLayerNorm if cfg.norm == "layernorm-seed" else LayerNorm
    return cls(cfg.d_model, cfg.norm_eps, bias=cfg.bias)
