"""The one frozen configuration that every model in the zoo is built from."""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("decoder", "encoder", "encoder-decoder")
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "t5", "shaw", "none")
NORMS = ("layernorm", "layernorm-seed", "rmsnorm")
FFNS = ("relu", "gelu", "gelu-tanh", "swiglu", "geglu")
ATTN_IMPLS = ("explicit", "sdpa")
# How the mask reaches the scores: added (−∞ entries), selected (``masked_fill(blocked, −∞)`` /
# ``where(keep, scores, finfo.min)``, any finite bias still added), or SDPA's ``is_causal``.
MASK_STYLES = ("add", "select-fill", "select-where", "is-causal")
# Operand orders of a norm's products (x normalized by r = rsqrt(ms) or s = sqrt(ms), weight w)
NORM_ORDERS = (
    "default",
    "x*r*w",
    "w*x*r",
    "x*w*r",
    "r*x*w",
    "r*w*x",
    "w*r*x",
    "w*(x*r)",
    "x*(w*r)",
    "(w*r)*x",
    "w*x/s",
    "x*w/s",
    "x/s*w",
    "w*(x/s)",
)


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a transformer; derived values are properties, never fields."""

    family: str = "decoder"  # decoder | encoder | encoder-decoder
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: as many as query heads (MHA); 1: MQA; else GQA
    d_ff: int | None = None  # None: 4 * d_model, as the seeds write it
    max_seq_len: int = 128
    # Positions: absolute ones are added to the embeddings (learned, sinusoidal); the others
    # act inside attention (rope rotates q and k; alibi, t5 and shaw change the scores).
    positions: str = "learned"  # learned | sinusoidal | rope | alibi | t5 | shaw | none
    position_offset: int = 0  # learned positions start at this row (RoBERTa and BART: 2)
    rope_theta: float = 10000.0
    rope_fraction: float = 1.0  # partial rotary (NeoX, phi): rotate this fraction of a head
    rope_ntk_factor: float = 1.0  # NTK-aware scaling α: θ' = θ·α^(d/(d−2))
    rel_buckets: int = 32  # T5: number of relative-position buckets
    rel_max_distance: int = 128  # T5: distance beyond which all offsets share a bucket
    shaw_max_distance: int = 8  # Shaw: relative distances are clipped to [−k, k]
    sliding_window: int | None = None  # Mistral: query i sees keys j with 0 ≤ i − j < window
    norm: str = "layernorm"  # layernorm | layernorm-seed (γ⊙(x−μ)/(σ+ε)+β) | rmsnorm
    norm_placement: str = "pre"  # pre | post
    norm_eps: float = 1e-5
    embed_norm: bool = False  # normalize the embeddings (BERT, BART, BLOOM)
    embed_scale: bool = False  # multiply token embeddings by √d_model (original Transformer)
    parallel_block: bool = False  # PaLM: x + attn(ln(x)) + ffn(ln(x))
    ffn: str = "gelu"  # relu | gelu (erf) | gelu-tanh | swiglu | geglu (gated GELU, Flan-T5)
    bias: bool = True  # biases of the linear layers and of LayerNorm
    tie_embeddings: bool = True  # LM head shares the token embedding matrix
    num_labels: int = 2  # encoder classifier head
    scale_scores: bool = True  # divide scores by √d_k (T5 folds it into its init: False)
    attn_impl: str = "explicit"  # explicit Q·Kᵀ/√d_k math | sdpa
    mask_style: str = "add"  # add | select-fill | select-where | is-causal (MASK_STYLES)
    softcap: float | None = None  # Gemma 2: scores = cap·tanh(scores / cap) before the mask
    norm_order: str = "default"  # the products of LayerNorm / RMSNorm in this order

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (an even number)."""
        return int(self.head_dim * self.rope_fraction) // 2 * 2

    @property
    def rope_base(self) -> float:
        """θ, NTK-scaled when ``rope_ntk_factor`` > 1: θ·α^(d/(d−2)) with d the rotary width."""
        if self.rope_ntk_factor == 1.0:
            return self.rope_theta
        d = self.rotary_dim
        return self.rope_theta * self.rope_ntk_factor ** (d / (d - 2))

    @property
    def final_norm(self) -> bool:
        """Pre-LN stacks end with a norm; post-LN ones already end normalized."""
        return self.norm_placement == "pre"

    def __post_init__(self) -> None:
        for name, allowed in (
            ("family", FAMILIES),
            ("positions", POSITIONS),
            ("norm", NORMS),
            ("ffn", FFNS),
            ("attn_impl", ATTN_IMPLS),
            ("norm_placement", ("pre", "post")),
            ("mask_style", MASK_STYLES),
            ("norm_order", NORM_ORDERS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {allowed}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}"
            )
        if self.positions == "rope":
            if self.rotary_dim < 2:
                raise ValueError(f"RoPE needs a rotary width ≥ 2, got {self.rotary_dim}")
            if self.rope_ntk_factor != 1.0 and self.rotary_dim <= 2:
                raise ValueError("NTK-aware RoPE scaling needs a rotary width > 2")
        if self.parallel_block and (
            self.norm_placement != "pre" or self.family == "encoder-decoder"
        ):
            raise ValueError("a parallel attention+FFN block is pre-LN and has no cross-attention")
        if self.positions == "shaw" and self.attn_impl == "sdpa":
            raise ValueError(
                "Shaw relative keys add q·r_{i−j} inside the scores; SDPA cannot express it"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be ≥ 1")
        if self.mask_style.startswith("select") and self.attn_impl != "explicit":
            raise ValueError("a selection mask is written in explicit attention (attn_impl)")
        if self.mask_style == "is-causal" and (
            self.attn_impl != "sdpa"
            or self.family == "encoder"
            or self.positions in ("alibi", "t5")
            or self.sliding_window is not None
        ):
            raise ValueError(
                "is_causal is SDPA's causal mask alone: it needs attn_impl='sdpa', a causal "
                "stack, and no ALiBi/T5 bias or sliding window"
            )
        if self.softcap is not None and (self.softcap <= 0 or self.attn_impl != "explicit"):
            raise ValueError("softcap must be > 0, in explicit attention (SDPA cannot cap)")
        if self.norm_order != "default" and self.norm == "layernorm-seed":
            raise ValueError("norm_order applies to layernorm and rmsnorm, not layernorm-seed")
