"""Rotary embeddings written with complex numbers (this directory is on sys.path in tests).

- ``MetaLM``: Meta's original LLaMA code: ``freqs_cis`` precomputed with ``torch.polar`` into a
  complex buffer, sliced per call, ``reshape_for_broadcast``, ``view_as_complex``;
- ``PolarLM``: the rotary module computes ``torch.polar`` per call from the positions
  (Hugging Face's Llama 4 and DeepSeek-V2).
"""

import torch
import torch.nn.functional as F
from torch import nn


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h, self.hd = h, d // h
        self.wq, self.wk = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.wv, self.wo = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x, freqs_cis):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.h, self.hd)
        k = self.wk(x).view(B, T, self.h, self.hd)
        v = self.wv(x).view(B, T, self.h, self.hd)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class PolarRotary(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, positions):  # (T,) -> complex (T, dim/2)
        freqs = positions[:, None].float() * self.inv_freq
        return torch.polar(torch.ones_like(freqs), freqs)


class LM(nn.Module):
    def __init__(self, polar: bool, vocab=64, d=32, h=4, layers=2, max_len=64):
        super().__init__()
        self.polar = polar
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Attention(d, h) for _ in range(layers))
        self.norms = nn.ModuleList(nn.RMSNorm(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        if polar:
            self.rotary = PolarRotary(d // h)
        else:
            self.register_buffer("freqs_cis", precompute_freqs_cis(d // h, max_len), False)

    def forward(self, idx):
        T = idx.shape[1]
        if self.polar:
            freqs_cis = self.rotary(torch.arange(T, device=idx.device))
        else:
            freqs_cis = self.freqs_cis[:T]
        x = self.emb(idx)
        for attn, norm in zip(self.layers, self.norms, strict=True):
            x = x + attn(norm(x), freqs_cis)
        return self.head(x)


def meta_lm():
    torch.manual_seed(0)
    return LM(polar=False).eval()


def polar_lm():
    torch.manual_seed(0)
    return LM(polar=True).eval()
