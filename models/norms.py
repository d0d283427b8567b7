"""Normalizations, written out by hand as the seeds write them."""

from __future__ import annotations

import torch
from torch import nn

from tfgraph.models.config import ModelConfig

# x normalized with its weight w, by r = rsqrt(ms + ε) or s = sqrt(ms + ε): each order the
# products may be written in (ModelConfig.norm_order)
PRODUCT_ORDERS = {
    "x*r*w": lambda x, w, r, s: x * r * w,
    "w*x*r": lambda x, w, r, s: w * x * r,
    "x*w*r": lambda x, w, r, s: x * w * r,
    "r*x*w": lambda x, w, r, s: r * x * w,
    "r*w*x": lambda x, w, r, s: r * w * x,
    "w*r*x": lambda x, w, r, s: w * r * x,
    "w*(x*r)": lambda x, w, r, s: w * (x * r),
    "x*(w*r)": lambda x, w, r, s: x * (w * r),
    "(w*r)*x": lambda x, w, r, s: (w * r) * x,
    "w*x/s": lambda x, w, r, s: w * x / s,
    "x*w/s": lambda x, w, r, s: x * w / s,
    "x/s*w": lambda x, w, r, s: x / s * w,
    "w*(x/s)": lambda x, w, r, s: w * (x / s),
}


def ordered(order: str, x: torch.Tensor, weight: torch.Tensor, ms: torch.Tensor) -> torch.Tensor:
    """``x`` normalized by ``ms + ε`` (already added) and scaled by ``weight``, in ``order``."""
    return PRODUCT_ORDERS[order](x, weight, torch.rsqrt(ms), torch.sqrt(ms))


class LayerNorm(nn.Module):
    """``γ ⊙ (x − μ)/√(σ² + ε) + β`` over the features of each token (as ``F.layer_norm``)."""

    def __init__(
        self, dim: int, eps: float = 1e-5, bias: bool = True, order: str = "default"
    ) -> None:
        super().__init__()
        self.eps, self.order = eps, order
        self.weight = nn.Parameter(torch.ones(dim))  # γ
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None  # β

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)  # biased variance σ²
        if self.order == "default":
            y = (x - mu) * torch.rsqrt(var + self.eps) * self.weight
        else:
            y = ordered(self.order, x - mu, self.weight, var + self.eps)
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

    def __init__(self, dim: int, eps: float = 1e-6, order: str = "default") -> None:
        super().__init__()
        self.eps, self.order = eps, order
        self.weight = nn.Parameter(torch.ones(dim))  # γ

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        ms = x32.pow(2).mean(-1, keepdim=True) + self.eps
        if self.order != "default":
            return ordered(self.order, x32, self.weight, ms).to(x.dtype)
        y = x32 * torch.rsqrt(ms)
        return self.weight * y.to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_order)
    if cfg.norm == "layernorm-seed":
        return SeedLayerNorm(cfg.d_model, cfg.norm_eps, bias=cfg.bias)
    return LayerNorm(cfg.d_model, cfg.norm_eps, bias=cfg.bias, order=cfg.norm_order)
