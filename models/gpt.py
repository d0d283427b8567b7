"""Decoder-only GPT written the way the seeds write it.

Explicit attention ``softmax(Q·Kᵀ/√d_k + M)·V`` with an additive causal −∞ mask, heads split and
concatenated then projected by ``W_O``, learned absolute positions, pre-LN blocks
``x = x + Sublayer(LayerNorm(x))``, a GELU FFN with ``d_ff = 4·d_model`` and an LM head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.attn_impl = cfg.attn_impl
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)  # W_Q
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)  # W_K
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)  # W_V
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)  # W_O

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = self.v_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        if self.attn_impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, nh, T, T)
            mask = torch.full((T, T), float("-inf"), device=x.device).triu(1)  # M_ij = −∞ if j > i
            weights = torch.softmax(scores + mask, dim=-1)  # (B, nh, T, T)
            y = weights @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, nh·hs): concat heads
        return self.o_proj(y)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)  # W_1
        self.down = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)  # W_2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """``logits = LMHead(LayerNorm(Blocks(E[input_ids] + P[positions])))``."""

    input_names = ("input_ids",)
    output_names = ("logits",)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.wte(input_ids) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)

    def example_inputs(self, batch: int, seq: int, generator: torch.Generator) -> dict:
        """Random inputs of the given shape (the tfgraph input protocol)."""
        ids = torch.randint(0, self.config.vocab_size, (batch, seq), generator=generator)
        return {"input_ids": ids}

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {"input_ids": {0: "batch", 1: "sequence"}}
