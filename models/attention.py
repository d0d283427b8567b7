"""Multi-head attention written out: ``softmax(Q·Kᵀ/√d_k + M)·V``, heads concatenated, ``W_O``.

One class covers MHA, MQA and GQA (through the number of KV heads), self- and cross-attention.
Masks and position biases arrive as one additive tensor ``M`` built from shapes by the stack.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tfgraph.models.config import ModelConfig
from tfgraph.models.positions import ShawRelativeKeys, apply_rope


def causal_mask(
    T: int, device: torch.device, *, window: int | None = None, dtype=torch.float32
) -> torch.Tensor:
    """``M_ij = −∞`` if ``j > i`` (or, with a sliding window, if ``i − j ≥ window``), else 0."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    blocked = j > i
    if window is not None:
        blocked = blocked | (i - j >= window)
    return torch.zeros(T, T, dtype=dtype, device=device).masked_fill(blocked, float("-inf"))


def padding_mask(attention_mask: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``−∞`` on the keys whose ``attention_mask`` is 0: (B, S) → (B, 1, 1, S)."""
    pad = attention_mask[:, None, None, :] == 0  # (B, 1, 1, S)
    return torch.zeros(pad.shape, dtype=dtype, device=pad.device).masked_fill(pad, float("-inf"))


class Attention(nn.Module):
    """Queries from ``x``; keys and values from ``x`` (self) or from ``context`` (cross)."""

    def __init__(self, cfg: ModelConfig, *, cross: bool = False, causal: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.scale_scores = cfg.scale_scores
        self.attn_impl = cfg.attn_impl
        self.mask_style, self.softcap = cfg.mask_style, cfg.softcap
        # SDPA's is_causal in causal self-attention: the stack then builds no causal mask
        self.is_causal = causal and not cross and cfg.mask_style == "is-causal"
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, q_dim, bias=cfg.bias)  # W_Q
        self.k_proj = nn.Linear(cfg.d_model, kv_dim, bias=cfg.bias)  # W_K
        self.v_proj = nn.Linear(cfg.d_model, kv_dim, bias=cfg.bias)  # W_V
        self.o_proj = nn.Linear(q_dim, cfg.d_model, bias=cfg.bias)  # W_O
        self.softmax = nn.Softmax(dim=-1)  # a module, so a hook can read the weights A
        self.rel_keys = ShawRelativeKeys(cfg) if cfg.positions == "shaw" and not cross else None

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        src = x if context is None else context
        S = src.shape[1]
        nh, nkv, hs = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(src).view(B, S, nkv, hs).transpose(1, 2)  # (B, nkv, S, hs)
        v = self.v_proj(src).view(B, S, nkv, hs).transpose(1, 2)  # (B, nkv, S, hs)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if nkv != nh:  # GQA / MQA: each KV head serves a group of nh/nkv query heads
            group = nh // nkv
            k = k.repeat_interleave(group, dim=1)  # (B, nh, S, hs)
            v = v.repeat_interleave(group, dim=1)  # (B, nh, S, hs)
        if self.attn_impl == "sdpa":
            scale = 1 / math.sqrt(hs) if self.scale_scores else 1.0
            if self.is_causal:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            # The fused CPU kernel lays y out as (B, T, nh, hs) while the decomposition that
            # torch.onnx traces lays it out as (B, nh, T, hs): copying to the standard layout
            # keeps the reshape below valid in both (else a learned bias, as T5's, fails export).
            y = y.clone(memory_format=torch.contiguous_format)  # (B, nh, T, hs)
        else:
            scores = q @ k.transpose(-2, -1)  # (B, nh, T, S)
            if self.rel_keys is not None:
                scores = scores + self.rel_keys(q, S)  # q_i · r_{i−j} W_K^R
            if self.scale_scores:
                scores = scores / math.sqrt(hs)
            if self.softcap is not None:
                scores = self.softcap * torch.tanh(scores / self.softcap)
            if mask is not None:
                scores = self._apply_mask(scores, mask)
            y = self.softmax(scores) @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, nh * hs)  # (B, T, nh·hs): concatenate the heads
        return self.o_proj(y)

    def _apply_mask(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.mask_style == "add":
            return scores + mask
        blocked = torch.isinf(mask)  # the −∞ entries select; any finite bias is still added
        scores = scores + mask.masked_fill(blocked, 0.0)
        if self.mask_style == "select-fill":
            return scores.masked_fill(blocked, float("-inf"))
        return torch.where(~blocked, scores, torch.finfo(scores.dtype).min)
