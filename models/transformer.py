"""One transformer family: blocks, stacks, and the three model kinds built from them.

- ``DecoderLM``: ``logits = LMHead(Stack_causal(Embed(input_ids)))`` (GPT, Llama, …).
- ``EncoderClassifier``: ``logits = W_cls h_0 + b_cls`` with h the bidirectional stack's output
  (BERT, RoBERTa).
- ``EncoderDecoderLM``: the encoder's output feeds K, V of every decoder cross-attention
  (original Transformer, T5, BART); one graph for the whole model.

Every model implements the tfgraph input protocol: ``input_names``, ``output_names``,
``example_inputs(batch, seq, generator)`` and ``dynamic_axes()``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tfgraph.models.attention import Attention, causal_mask, padding_mask
from tfgraph.models.config import ModelConfig
from tfgraph.models.ffn import make_ffn
from tfgraph.models.norms import make_norm
from tfgraph.models.positions import ALiBi, RotaryEmbedding, T5RelativeBias, sinusoidal


class Embeddings(nn.Module):
    """``x = E[ids]·s + P(pos)``, then LayerNorm in BERT-style models.

    ``s = √d_model`` in the original Transformer, else 1; ``P`` is a learned table (BERT, GPT-2)
    or the sinusoidal encoding; models with relative positions add nothing here.
    """

    def __init__(self, cfg: ModelConfig, tok: nn.Embedding | None = None) -> None:
        super().__init__()
        self.d_model, self.positions, self.offset = cfg.d_model, cfg.positions, cfg.position_offset
        self.scale = math.sqrt(cfg.d_model) if cfg.embed_scale else None
        self.tok = tok if tok is not None else nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = None
        if cfg.positions == "learned":
            self.pos = nn.Embedding(cfg.max_seq_len + cfg.position_offset, cfg.d_model)
        self.norm = make_norm(cfg) if cfg.embed_norm else nn.Identity()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids)  # (B, T, C)
        if self.scale is not None:
            x = x * self.scale
        T = input_ids.shape[1]
        positions = torch.arange(self.offset, T + self.offset, device=input_ids.device)  # (T,)
        if self.pos is not None:
            x = x + self.pos(positions)
        elif self.positions == "sinusoidal":
            x = x + sinusoidal(positions, self.d_model).to(x.dtype)
        return self.norm(x)


class Block(nn.Module):
    """A transformer layer with residual connections around each sublayer.

    Pre-LN: ``x = x + Attn(LN(x))``, ``x = x + FFN(LN(x))``. Post-LN (the original):
    ``x = LN(x + Attn(x))``, ``x = LN(x + FFN(x))``. Decoder layers of an encoder-decoder put
    cross-attention over the encoder output (``memory``) between the two.
    """

    def __init__(self, cfg: ModelConfig, *, cross: bool = False, causal: bool = False) -> None:
        super().__init__()
        self.post_ln = cfg.norm_placement == "post"
        self.ln_1 = make_norm(cfg)
        self.attn = Attention(cfg, causal=causal)
        self.ln_cross = make_norm(cfg) if cross else None
        self.cross_attn = Attention(cfg, cross=True) if cross else None
        self.ln_2 = make_norm(cfg)
        self.mlp = make_ffn(cfg)

    def forward(self, x, mask=None, rope=None, memory=None, memory_mask=None) -> torch.Tensor:
        if self.post_ln:
            x = self.ln_1(x + self.attn(x, mask, rope))
            if self.cross_attn is not None:
                x = self.ln_cross(x + self.cross_attn(x, memory_mask, context=memory))
            return self.ln_2(x + self.mlp(x))
        x = x + self.attn(self.ln_1(x), mask, rope)
        if self.cross_attn is not None:
            x = x + self.cross_attn(self.ln_cross(x), memory_mask, context=memory)
        return x + self.mlp(self.ln_2(x))


class ParallelBlock(nn.Module):
    """PaLM's layer: attention and FFN read the same normalized input, ``x + Attn(h) + FFN(h)``."""

    def __init__(self, cfg: ModelConfig, *, causal: bool = False) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = Attention(cfg, causal=causal)
        self.mlp = make_ffn(cfg)

    def forward(self, x, mask=None, rope=None, memory=None, memory_mask=None) -> torch.Tensor:
        h = self.ln_1(x)
        return x + self.attn(h, mask, rope) + self.mlp(h)


class TransformerStack(nn.Module):
    """N layers plus what they share: the attention mask and position biases, built once from
    shapes (and the padding mask), RoPE angles, and the final norm of pre-LN stacks."""

    def __init__(self, cfg: ModelConfig, *, causal: bool, cross: bool = False) -> None:
        super().__init__()
        self.causal, self.window = causal, cfg.sliding_window
        self.is_causal = causal and cfg.mask_style == "is-causal"  # SDPA masks by itself
        self.rotary = RotaryEmbedding(cfg) if cfg.positions == "rope" else None
        self.position_bias = None
        if cfg.positions == "alibi":
            self.position_bias = ALiBi(cfg, causal=causal)
        elif cfg.positions == "t5":
            self.position_bias = T5RelativeBias(cfg, bidirectional=not causal)
        if cfg.parallel_block:
            blocks = (ParallelBlock(cfg, causal=causal) for _ in range(cfg.n_layers))
        else:
            blocks = (Block(cfg, cross=cross, causal=causal) for _ in range(cfg.n_layers))
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = make_norm(cfg) if cfg.final_norm else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        T, device = x.shape[1], x.device
        mask = None  # additive, broadcast to (B, nh, T, T)
        if self.causal and not self.is_causal:
            mask = causal_mask(T, device, window=self.window, dtype=x.dtype)  # (T, T)
        if self.position_bias is not None:
            bias = self.position_bias(T, T, device).to(x.dtype)  # (1, nh, T, T)
            mask = bias if mask is None else mask + bias
        if attention_mask is not None:
            pad = padding_mask(attention_mask, x.dtype)  # (B, 1, 1, T)
            mask = pad if mask is None else mask + pad
        cross_mask = None if memory_mask is None else padding_mask(memory_mask, x.dtype)
        rope = None
        if self.rotary is not None:
            cos, sin = self.rotary(torch.arange(T, device=device))  # angles in fp32
            rope = cos.to(x.dtype), sin.to(x.dtype)  # (T, d) each, in the model's precision
        for block in self.blocks:
            x = block(x, mask, rope, memory, cross_mask)
        return self.ln_f(x)


def _token_ids(cfg: ModelConfig, batch: int, seq: int, generator: torch.Generator):
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator)


def _right_padding(batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """1 on tokens, 0 on padding: row 0 is full, every other row keeps 1 … seq−1 tokens."""
    lengths = torch.randint(1, max(seq, 2), (batch,), generator=generator)
    lengths[0] = seq
    return (torch.arange(seq)[None, :] < lengths[:, None]).long()  # (B, T)


class DecoderLM(nn.Module):
    """``logits = LMHead(Stack_causal(Embed(input_ids)))``, the head tied to E or not."""

    input_names = ("input_ids",)
    output_names = ("logits",)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = Embeddings(cfg)
        self.decoder = TransformerStack(cfg, causal=True)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.tok.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.decoder(self.embed(input_ids)))  # (B, T, vocab)

    def example_inputs(self, batch: int, seq: int, generator: torch.Generator) -> dict:
        return {"input_ids": _token_ids(self.config, batch, seq, generator)}

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {"input_ids": {0: "batch", 1: "sequence"}}


class EncoderClassifier(nn.Module):
    """``logits = W_cls h + b_cls`` on the first token's final representation h."""

    input_names = ("input_ids", "attention_mask")
    output_names = ("logits",)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = Embeddings(cfg)
        self.encoder = TransformerStack(cfg, causal=False)
        self.classifier = nn.Linear(cfg.d_model, cfg.num_labels)  # W_cls, b_cls

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(input_ids), attention_mask)  # (B, T, C)
        return self.classifier(h[:, 0])  # (B, num_labels)

    def example_inputs(self, batch: int, seq: int, generator: torch.Generator) -> dict:
        return {
            "input_ids": _token_ids(self.config, batch, seq, generator),
            "attention_mask": _right_padding(batch, seq, generator),
        }

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {
            "input_ids": {0: "batch", 1: "sequence"},
            "attention_mask": {0: "batch", 1: "sequence"},
        }


class EncoderDecoderLM(nn.Module):
    """``logits = LMHead(Decoder(Embed(decoder_input_ids), memory=Encoder(Embed(input_ids))))``.

    Encoder and decoder share the token embedding (and the LM head when tied); the padding
    mask of the source masks encoder self-attention and decoder cross-attention.
    """

    input_names = ("input_ids", "decoder_input_ids", "attention_mask")
    output_names = ("logits",)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder_embed = Embeddings(cfg, self.shared)
        self.encoder = TransformerStack(cfg, causal=False)
        self.decoder_embed = Embeddings(cfg, self.shared)
        self.decoder = TransformerStack(cfg, causal=True, cross=True)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.shared.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        memory = self.encoder(self.encoder_embed(input_ids), attention_mask)  # (B, S, C)
        h = self.decoder(self.decoder_embed(decoder_input_ids), None, memory, attention_mask)
        return self.lm_head(h)  # (B, T, vocab)

    def example_inputs(self, batch: int, seq: int, generator: torch.Generator) -> dict:
        return {
            "input_ids": _token_ids(self.config, batch, seq, generator),
            "decoder_input_ids": _token_ids(self.config, batch, seq, generator),
            "attention_mask": _right_padding(batch, seq, generator),
        }

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {
            "input_ids": {0: "batch", 1: "sequence"},
            "decoder_input_ids": {0: "batch", 1: "decoder_sequence"},
            "attention_mask": {0: "batch", 1: "sequence"},
        }


MODELS: dict[str, type[nn.Module]] = {
    "decoder": DecoderLM,
    "encoder": EncoderClassifier,
    "encoder-decoder": EncoderDecoderLM,
}
