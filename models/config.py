"""The one frozen configuration that every model in the zoo is built from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a transformer; derived values are properties, never fields."""

    family: str = "decoder"  # decoder | encoder | encoder-decoder
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: as many as query heads (MHA)
    d_ff: int | None = None  # None: 4 * d_model, as the seeds write it
    max_seq_len: int = 128
    positions: str = "learned"  # learned | sinusoidal | ...
    norm: str = "layernorm"  # layernorm | ...
    norm_placement: str = "pre"  # pre | post
    norm_eps: float = 1e-5
    ffn: str = "gelu"  # relu | gelu | ...
    bias: bool = True
    tie_embeddings: bool = True
    attn_impl: str = "explicit"  # explicit Q·Kᵀ/√d_k math | sdpa

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}")
