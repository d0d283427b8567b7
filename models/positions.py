"""Position information: absolute (sinusoidal, learned), rotary, and biases on the scores.

Everything here is computed from shapes (``torch.arange``) inside ``forward``, so exported graphs
keep a dynamic sequence length.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tfgraph.models.config import ModelConfig

# --- absolute positions, added to the token embeddings ---------------------------------------


def sinusoidal(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """``PE(pos, 2i) = sin(pos/10000^(2i/d))``, ``PE(pos, 2i+1) = cos(pos/10000^(2i/d))``."""
    two_i = torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32)
    angle = positions.float()[:, None] / 10000 ** (two_i / d_model)  # (T, d/2)
    pe = torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(-2)  # (T, 2⌈d/2⌉): sin, cos, …
    return pe[:, :d_model] if d_model % 2 else pe  # odd d: the last column is sin (2i = d − 1)


# --- rotary positions (RoPE), applied to q and k ----------------------------------------------


class RotaryEmbedding(nn.Module):
    """``cos(pos·θ_i)`` and ``sin(pos·θ_i)`` with ``θ_i = base^(−2i/d)`` for the rotary width d.

    Pairs are (i, i + d/2) (the GPT-NeoX / Llama layout); with ``rope_fraction`` < 1 only the
    first d dimensions of each head rotate (NeoX, phi); ``rope_ntk_factor`` raises the base.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.rotary_dim
        inv_freq = 1.0 / cfg.rope_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (d/2,)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, d/2)
        angle = torch.cat([freqs, freqs], dim=-1)  # (T, d)
        return angle.cos(), angle.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_i, x_{i+d/2}) of ``x`` (B, nh, T, hs) by the angle of its position."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :d], x[..., d:]  # partial rotary: the rest passes through
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


# --- ALiBi: a linear penalty on the scores ----------------------------------------------------


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Head slopes m: the geometric series ``2^(−8/n)``, ``2^(−16/n)``, … for n a power of 2.

    Otherwise (Press et al.): the slopes of the closest power of two below n, then every other
    slope of twice that many heads for the remaining ones.
    """

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two(closest)
    if closest != n_heads:
        slopes += power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


class ALiBi(nn.Module):
    """Bias ``−m·|i−j|`` on the scores; ``−m·(i−j)`` for causal attention (only j ≤ i count)."""

    def __init__(self, cfg: ModelConfig, *, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.register_buffer("slopes", alibi_slopes(cfg.n_heads), persistent=False)  # (nh,)

    def forward(self, T: int, S: int, device: torch.device) -> torch.Tensor:
        i = torch.arange(T, device=device)[:, None]
        j = torch.arange(S, device=device)[None, :]
        distance = (i - j) if self.causal else (i - j).abs()  # (T, S)
        return -self.slopes[None, :, None, None] * distance.float()  # (1, nh, T, S)


# --- T5: learned scalar bias per head and bucket of relative position -------------------------


def t5_relative_bucket(
    relative_position: torch.Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of ``relative_position = j − i``.

    Half the buckets (per direction when bidirectional) hold exact small distances; the rest
    cover distances up to ``max_distance`` logarithmically, and farther ones share the last.
    """
    bucket = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        bucket = (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)  # only the past: j ≤ i
    max_exact = num_buckets // 2
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(
        max_distance / max_exact
    )
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < max_exact, distance, large)


class T5RelativeBias(nn.Module):
    """``b[bucket(j − i), h]`` added to the scores; one table per stack, shared by its layers."""

    def __init__(self, cfg: ModelConfig, *, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets, self.max_distance = cfg.rel_buckets, cfg.rel_max_distance
        self.bias = nn.Embedding(cfg.rel_buckets, cfg.n_heads)

    def forward(self, T: int, S: int, device: torch.device) -> torch.Tensor:
        i = torch.arange(T, device=device)[:, None]
        j = torch.arange(S, device=device)[None, :]
        buckets = t5_relative_bucket(
            j - i,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )  # (T, S)
        return self.bias(buckets).permute(2, 0, 1)[None]  # (1, nh, T, S)


# --- Shaw et al.: relative key embeddings -----------------------------------------------------


class ShawRelativeKeys(nn.Module):
    """The relative term of ``S_ij = (x_i W_Q)(x_j W_K + r_{i−j} W_K^R)ᵀ/√d_k``.

    ``r`` is a learned embedding of the clipped distance ``clip(i − j, −k, k)``; ``W_K^R``
    projects it into every head. Returns ``q_i · (r_{i−j} W_K^R)`` (before the 1/√d_k scale).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.k = cfg.shaw_max_distance
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.r = nn.Embedding(2 * self.k + 1, cfg.d_model)  # r_{−k} … r_{k}
        self.w_kr = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)  # W_K^R

    def forward(self, q: torch.Tensor, S: int) -> torch.Tensor:
        T = q.shape[2]
        i = torch.arange(T, device=q.device)[:, None]
        j = torch.arange(S, device=q.device)[None, :]
        index = (i - j).clamp(-self.k, self.k) + self.k  # (T, S)
        rel = self.w_kr(self.r.weight)[index]  # (T, S, nh·hs)
        rel = rel.view(T, S, self.n_heads, self.head_dim)  # (T, S, nh, hs)
        return torch.einsum("bhtd,tshd->bhts", q, rel)  # (B, nh, T, S)
