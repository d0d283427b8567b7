"""Models written the ways people write them, not the way the zoo does (factories for
``export tests.idiom_models:NAME``-style tests; this directory is on sys.path in tests).

- ``gpt`` / ``gpt_gqa``: nanoGPT style, ``F.scaled_dot_product_attention(..., is_causal=True)``
  (``enable_gqa=True`` with 2 KV heads for 4 query heads);
- ``mha_lm``: ``nn.MultiheadAttention(..., is_causal=True)`` with the causal mask it requires;
- ``seq2seq``: ``nn.Transformer(..., tgt_is_causal=True)``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from tfgraph.models.norms import PRODUCT_ORDERS


class Attn(nn.Module):
    def __init__(self, d, h, kv=None):
        super().__init__()
        self.h, self.kv = h, kv or h
        self.hs = d // h
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, self.kv * self.hs)
        self.v = nn.Linear(d, self.kv * self.hs)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.h, self.hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k(x).view(B, T, self.kv, self.hs).transpose(1, 2)
        v = self.v(x).view(B, T, self.kv, self.hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d, h, kv=None):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attn(d, h, kv)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=64, d=32, h=4, layers=2, kv=None, n_pos=64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(n_pos, d)
        self.blocks = nn.ModuleList(Block(d, h, kv) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def gpt():
    torch.manual_seed(0)
    return GPT()


def gpt_gqa():
    torch.manual_seed(0)
    return GPT(h=4, kv=2)


class MHABlock(nn.Module):
    """nn.MultiheadAttention with is_causal=True and the causal mask it requires."""

    def __init__(self, d, h):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)

    def forward(self, x):
        T = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(T, dtype=x.dtype)
        h = self.ln(x)
        y, _ = self.attn(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)
        return x + y


class MHALM(nn.Module):
    def __init__(self, vocab=64, d=32, h=4, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MHABlock(d, h) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def mha_lm():
    torch.manual_seed(0)
    return MHALM().eval()


class Seq2Seq(nn.Module):
    """nn.Transformer with tgt_is_causal=True."""

    input_names = ("input_ids", "decoder_input_ids")
    output_names = ("logits",)

    def __init__(self, vocab=64, d=32, h=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.core = nn.Transformer(d, h, 1, 1, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, decoder_input_ids):
        T = decoder_input_ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(T)
        src, tgt = self.emb(input_ids), self.emb(decoder_input_ids)
        y = self.core(src, tgt, tgt_mask=mask, tgt_is_causal=True)
        return self.head(y)

    def example_inputs(self, batch, seq, generator):
        return {
            "input_ids": torch.randint(0, 64, (batch, seq), generator=generator),
            "decoder_input_ids": torch.randint(
                0, 64, (batch, max(1, seq - 2)), generator=generator
            ),
        }

    def dynamic_axes(self):
        return {
            "input_ids": {0: "batch", 1: "sequence"},
            "decoder_input_ids": {0: "batch", 1: "decoder_sequence"},
        }


def seq2seq():
    torch.manual_seed(0)
    return Seq2Seq().eval()


# --- norms written in every operand order -----------------------------------------------------
# x: the input, w: the per-feature scale, r: rsqrt(mean(x²) + ε) (LayerNorm: of the variance),
# s: sqrt(…) for the division forms; d = x − mean(x) for LayerNorm.
RMS_ORDERS = PRODUCT_ORDERS  # the zoo's table (ModelConfig.norm_order): one source


class HandNorm(nn.Module):
    """RMSNorm or LayerNorm (``centered``) written out with the products in ``order``."""

    def __init__(self, d: int, order: str, centered: bool, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.bias = nn.Parameter(torch.randn(d) * 0.1) if centered else None
        self.order, self.centered, self.eps = order, centered, eps

    def forward(self, x):
        if self.centered:
            x = x - x.mean(-1, keepdim=True)
        ms = x.pow(2).mean(-1, keepdim=True) + self.eps
        y = RMS_ORDERS[self.order](x, self.weight, torch.rsqrt(ms), torch.sqrt(ms))
        return y + self.bias if self.bias is not None else y


class NormStack(nn.Module):
    """Embedding, then one residual block per (order, centered) pair, each with a
    hand-written norm written in that order, then a head."""

    def __init__(self, layouts: list[tuple[str, bool]], d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, d)
        self.norms = nn.ModuleList(HandNorm(d, o, c) for o, c in layouts)
        self.mix = nn.ModuleList(nn.Linear(d, d) for _ in layouts)
        self.head = nn.Linear(d, 64)

    def forward(self, idx):
        x = self.emb(idx)
        for norm, mix in zip(self.norms, self.mix, strict=True):
            x = x + mix(norm(x))
        return self.head(x)


def every_norm_order():
    """RMSNorm and LayerNorm in each operand order of :data:`RMS_ORDERS`: 26 norms."""
    torch.manual_seed(0)
    return NormStack([(o, c) for c in (False, True) for o in RMS_ORDERS]).eval()


# --- mixture of experts ------------------------------------------------------------------------
class MoE(nn.Module):
    """A top-2 router over 4 experts: ``softmax(x · W_router)`` is a gate, not attention."""

    def __init__(self, d: int, experts: int = 4, top: int = 2, topk_first: bool = False) -> None:
        super().__init__()
        self.topk_first = topk_first  # Aria: softmax over the top-k logits only
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
            for _ in range(experts)
        )
        self.top = top

    def forward(self, x):
        logits = self.router(x)  # (B, T, E)
        if self.topk_first:
            top, index = logits.topk(self.top, dim=-1)
            weight = torch.softmax(top, dim=-1)  # (B, T, k)
        else:
            weight, index = torch.softmax(logits, dim=-1).topk(self.top, dim=-1)
        gate = torch.zeros_like(logits).scatter(-1, index, weight)  # dense: traceable
        outs = torch.stack([e(x) for e in self.experts], dim=-1)  # (B, T, d, E)
        return (outs * gate.unsqueeze(-2)).sum(-1)


class MoEBlock(Block):
    def __init__(self, d, h, topk_first=False):
        super().__init__(d, h)
        self.mlp = MoE(d, topk_first=topk_first)


class MoEGPT(GPT):
    def __init__(self, vocab=64, d=32, h=4, layers=2, n_pos=64, topk_first=False):
        super().__init__(vocab, d, h, layers, None, n_pos)
        self.blocks = nn.ModuleList(MoEBlock(d, h, topk_first) for _ in range(layers))


def moe_gpt(topk_first: bool = False):
    torch.manual_seed(0)
    return MoEGPT(topk_first=topk_first).eval()


# --- scores masked by selection ----------------------------------------------------------------
class SelectAttn(nn.Module):
    """Explicit attention whose causal mask selects instead of adding (``style``):

    - ``masked_fill``: ``scores.masked_fill(mask == 0, -inf)`` (mask 1 = attend);
    - ``where_min``: ``torch.where(keep, scores, finfo.min)``;
    - ``bias_and_select``: an ALiBi-like additive bias, then ``masked_fill`` (both at once);
    - ``select_then_bias``: GPT-Neo's order, ``where(keep, scores, finfo.min)`` first, then an
      additive bias (its padding mask; here ALiBi-like) added to the selected scores.
    """

    def __init__(self, d, h, style):
        super().__init__()
        self.h, self.hs, self.style = h, d // h, style
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.register_buffer("slopes", torch.tensor([2.0 ** -(i + 1) for i in range(h)]))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, self.hs).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / self.hs**0.5  # (B, nh, T, T)
        pos = torch.arange(T)
        keep = pos[None, :] <= pos[:, None]  # (T, T) causal
        if self.style == "bias_and_select":
            scores = scores + self.slopes[:, None, None] * (pos[None, :] - pos[:, None])
        if self.style in ("where_min", "select_then_bias"):
            scores = torch.where(keep, scores, torch.finfo(scores.dtype).min)
            if self.style == "select_then_bias":
                scores = scores + self.slopes[:, None, None] * (pos[None, :] - pos[:, None])
        else:
            scores = scores.masked_fill(keep.to(torch.int64) == 0, float("-inf"))
        y = torch.softmax(scores, dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class SelectBlock(Block):
    def __init__(self, d, h, style):
        super().__init__(d, h)
        self.attn = SelectAttn(d, h, style)


class SelectGPT(GPT):
    def __init__(self, style, vocab=64, d=32, h=4, layers=2, n_pos=64):
        super().__init__(vocab, d, h, layers, None, n_pos)
        self.blocks = nn.ModuleList(SelectBlock(d, h, style) for _ in range(layers))


def select_gpt(style: str):
    torch.manual_seed(0)
    return SelectGPT(style).eval()


# --- soft-capped scores (Gemma 2) --------------------------------------------------------------
class SoftcapAttn(nn.Module):
    """``cap · tanh(scale·Q·Kᵀ / cap)``, then a causal mask, with a sliding window of
    ``window`` keys when given (Gemma 2 alternates windowed and global layers)."""

    def __init__(self, d, h, kv, cap, window):
        super().__init__()
        self.h, self.kv, self.hs, self.cap, self.window = h, kv, d // h, cap, window
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv * self.hs, bias=False)
        self.v = nn.Linear(d, kv * self.hs, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.h, self.hs).transpose(1, 2) * self.hs**-0.5
        k = self.k(x).view(B, T, self.kv, self.hs).transpose(1, 2)
        v = self.v(x).view(B, T, self.kv, self.hs).transpose(1, 2)
        k = k.repeat_interleave(self.h // self.kv, dim=1)  # (B, nh, T, hs)
        v = v.repeat_interleave(self.h // self.kv, dim=1)
        scores = torch.tanh((q @ k.transpose(-2, -1)) / self.cap) * self.cap
        pos = torch.arange(T)
        behind = pos[:, None] - pos[None, :]
        masked = behind < 0
        if self.window:
            masked = masked | (behind >= self.window)
        scores = scores + torch.where(masked, torch.finfo(scores.dtype).min, 0.0)
        y = torch.softmax(scores, dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class SoftcapBlock(Block):
    def __init__(self, d, h, window):
        super().__init__(d, h)
        self.attn = SoftcapAttn(d, h, kv=2, cap=5.0, window=window)


class SoftcapGPT(GPT):
    """4 layers: windowed (3 keys) and global in turn, head size 8, GQA 4:2."""

    def __init__(self, vocab=64, d=32, h=4, layers=4, n_pos=64):
        super().__init__(vocab, d, h, layers, None, n_pos)
        windows = [3 if i % 2 == 0 else 0 for i in range(layers)]
        self.blocks = nn.ModuleList(SoftcapBlock(d, h, w) for w in windows)


def softcap_gpt():
    torch.manual_seed(0)
    model = SoftcapGPT().eval()
    with torch.no_grad():  # scores large enough for the cap to matter
        for block in model.blocks:
            block.attn.q.weight.mul_(4.0)
    return model


def short_gpt():
    """A zoo decoder with 16 learned positions: fewer than the default parity shapes' 33."""
    from tfgraph.models.config import ModelConfig
    from tfgraph.models.presets import build

    return build(
        ModelConfig(
            family="decoder", vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=16
        )
    )


def t5_decoder():
    """A decoder-only model with T5's relative buckets (unidirectional) in every layer: a
    position bias over queries × keys that is a function of i − j but not linear in it."""
    import torch

    from tfgraph.models.config import ModelConfig
    from tfgraph.models.presets import build

    torch.manual_seed(0)
    cfg = ModelConfig(
        family="decoder", vocab_size=64, d_model=32, n_layers=2, n_heads=2, positions="t5",
        norm="rmsnorm", bias=False, scale_scores=False,
    )  # fmt: skip
    return build(cfg).eval()


# --- attention sinks (gpt-oss, Granite SWA) ----------------------------------------------------
class SinkAttn(SoftcapAttn):
    """Causal GQA (4:2, head size 8) with a learned logit per head in the softmax's
    denominator, written as ``style`` says:

    - ``concat``: gpt-oss, the sink column concatenated to the scores, the row max subtracted,
      softmax, the column dropped;
    - ``concat_plain``: Flint's, the same without the max;
    - ``sigmoid``: Granite SWA's, ``softmax(s) · V · σ(logsumexp(s) − sink)``;
    - ``per_token``: Inkling 2's, a sink projected from each token's hidden state (not one
      per head: not fused);
    - ``max_shift``: no sink, the row max subtracted before the softmax (MiMo-V2-Flash's
      layers without sinks).

    ``window`` keys (0: all) on this layer.
    """

    def __init__(self, d, h, kv, style, window):
        super().__init__(d, h, kv, cap=None, window=window)  # the same projections
        self.style = style
        self.sinks = nn.Parameter(torch.randn(h))
        if style == "per_token":
            self.sink_proj = nn.Linear(d, h)

    def forward(self, x):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.h, self.hs).transpose(1, 2)
        k = self.k(x).view(B, T, self.kv, self.hs).transpose(1, 2)
        v = self.v(x).view(B, T, self.kv, self.hs).transpose(1, 2)
        k = k.repeat_interleave(self.h // self.kv, dim=1)
        v = v.repeat_interleave(self.h // self.kv, dim=1)
        scores = (q @ k.transpose(-2, -1)) * self.hs**-0.5
        pos = torch.arange(T)
        behind = pos[:, None] - pos[None, :]
        masked = behind < 0
        if self.window:
            masked = masked | (behind >= self.window)
        scores = scores + torch.where(masked, torch.finfo(scores.dtype).min, 0.0)
        if self.style == "max_shift":
            y = torch.softmax(scores - scores.max(dim=-1, keepdim=True).values, dim=-1) @ v
        elif self.style == "sigmoid":
            gate = torch.sigmoid(torch.logsumexp(scores, dim=-1) - self.sinks.view(1, -1, 1))
            y = (torch.softmax(scores, dim=-1) @ v) * gate.unsqueeze(-1)
        else:
            if self.style == "per_token":
                sinks = self.sink_proj(x).transpose(1, 2).unsqueeze(-1)  # (B, h, T, 1)
            else:
                sinks = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, T, -1)
            combined = torch.cat([scores, sinks], dim=-1)
            if self.style == "concat":
                combined = combined - combined.max(dim=-1, keepdim=True).values
            y = torch.softmax(combined, dim=-1)[..., :-1] @ v
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class SinkBlock(Block):
    def __init__(self, d, h, style, window):
        super().__init__(d, h)
        self.attn = SinkAttn(d, h, kv=2, style=style, window=window)


class SinkGPT(GPT):
    """2 layers: windowed (3 keys) then global."""

    def __init__(self, style, vocab=64, d=32, h=4, layers=2, n_pos=64):
        super().__init__(vocab, d, h, layers, None, n_pos)
        windows = [3 if i % 2 == 0 else 0 for i in range(layers)]
        self.blocks = nn.ModuleList(SinkBlock(d, h, style, w) for w in windows)


def sink_gpt(style: str = "concat"):
    torch.manual_seed(0)
    return SinkGPT(style).eval()


# --- token mixing outside attention (Mamba's short convolution, a running mean) --------------
class MixBlock(Block):
    """A block whose input first goes through ``mix`` along the sequence: ``conv``, a causal
    depthwise convolution of width 3 (Mamba's, hybrid models'); ``cumsum``, a running mean."""

    def __init__(self, d, h, mix):
        super().__init__(d, h)
        self.mix = mix
        self.conv = nn.Conv1d(d, d, 3, groups=d, padding=2)

    def forward(self, x):
        if self.mix == "conv":
            x = x + self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        else:
            steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]
            x = x + x.cumsum(1) / steps
        return super().forward(x)


class MixGPT(GPT):
    def __init__(self, mix, vocab=64, d=32, h=4, layers=2, n_pos=64):
        super().__init__(vocab, d, h, layers, None, n_pos)
        self.blocks = nn.ModuleList(MixBlock(d, h, mix) for _ in range(layers))


def mix_gpt(mix: str = "conv"):
    torch.manual_seed(0)
    return MixGPT(mix).eval()


# --- positions read from a buffer sliced to the input (BERT's position_ids buffer) -----------
class BufferPosGPT(GPT):
    """``wpe(self.position_ids[:, :T])``: torch.export names that axis ``Min(64, sequence)``.
    With ``limit``, a ``config`` states the model's 64 positions (as a Hugging Face config's
    ``max_position_embeddings`` does)."""

    def __init__(self, limit: bool, vocab=64, d=32, h=4, layers=2, n_pos=64):
        super().__init__(vocab, d, h, layers, None, n_pos)
        self.register_buffer("position_ids", torch.arange(n_pos)[None], persistent=False)
        if limit:
            self.config = type("Config", (), {"max_position_embeddings": n_pos})()

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(self.position_ids[:, : idx.shape[1]])
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def buffer_pos_gpt(limit: bool = True):
    torch.manual_seed(0)
    return BufferPosGPT(limit).eval()


# --- two attention calls on one Q and K (DiffLlama's differential attention) ------------------
class TwoValueAttn(Attn):
    """``sdpa(q, k, v1)`` and ``sdpa(q, k, v2)`` (the two halves of V), their difference
    weighted: common subexpression elimination leaves one softmax feeding two MatMuls."""

    def forward(self, x):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.h, self.hs).transpose(1, 2)
        k = self.k(x).view(B, T, self.kv, self.hs).transpose(1, 2)
        v = self.v(x).view(B, T, self.kv, self.hs).transpose(1, 2)
        v1, v2 = (u.repeat(1, 2, 1, 1) for u in torch.chunk(v, 2, dim=1))
        y1 = F.scaled_dot_product_attention(q, k, v1, is_causal=True)
        y2 = F.scaled_dot_product_attention(q, k, v2, is_causal=True)
        return self.o((y1 - 0.5 * y2).transpose(1, 2).reshape(B, T, C))


class TwoValueBlock(Block):
    def __init__(self, d, h):
        super().__init__(d, h)
        self.attn = TwoValueAttn(d, h)


class TwoValueGPT(GPT):
    def __init__(self, vocab=64, d=32, h=4, layers=2, n_pos=64):
        super().__init__(vocab, d, h, layers, None, n_pos)
        self.blocks = nn.ModuleList(TwoValueBlock(d, h) for _ in range(layers))


def two_value_gpt():
    torch.manual_seed(0)
    return TwoValueGPT().eval()


class LeftPaddedInputs:
    """The tfgraph input protocol for a module taking ``input_ids`` and ``attention_mask``:
    random ids below ``vocab``, rows after the first left-padded by a third."""

    input_names = ("input_ids", "attention_mask")
    output_names = ("logits",)
    vocab = 64

    def example_inputs(self, batch, seq, generator):
        ids = torch.randint(1, self.vocab, (batch, seq), generator=generator)
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[1:, : seq // 3] = 0  # rows after the first are left-padded
        return {"input_ids": ids, "attention_mask": mask}

    def dynamic_axes(self):
        return {n: {0: "batch", 1: "sequence"} for n in self.input_names}


class AbsoluteBiasLM(LeftPaddedInputs, nn.Module):
    """A bias over absolute (query, key) positions, ``sin(0.3 i) · cos(0.7 j)`` per head, plus
    the causal and padding mask from ``attention_mask``: a padding bias that does not move
    with left padding (not a function of i − j), so rows at their own lengths cannot read it
    shifted."""

    def __init__(self, vocab=64, d=32, h=2):
        super().__init__()
        self.h, self.hs = h, d // h
        self.emb = nn.Embedding(vocab, d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.slope = nn.Parameter(torch.linspace(1.0, 2.0, h)[:, None, None])
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask):
        B, T = input_ids.shape
        x = self.emb(input_ids)
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.hs).permute(2, 0, 3, 1, 4)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        pos = torch.arange(T, device=x.device, dtype=x.dtype)
        bias = self.slope * (torch.sin(0.3 * pos)[:, None] * torch.cos(0.7 * pos)[None, :])
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        keep = causal[None, None] & attention_mask[:, None, None, :].bool()
        bias = bias[None].masked_fill(~keep, torch.finfo(x.dtype).min)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.head(x + self.o(y.transpose(1, 2).contiguous().reshape(B, T, -1)))


def absolute_bias_lm():
    torch.manual_seed(0)
    return AbsoluteBiasLM().eval()


# --- positions counted from the token ids (fairseq / M2M100 / RoBERTa) ------------------------
class CountedPosGPT(GPT):
    """``cumsum(idx != pad) * (idx != pad) + pad``: a pad token keeps position ``pad`` and does
    not advance the count, as M2M100's ``create_position_ids_from_input_ids`` does."""

    def __init__(self, vocab=64, d=32, h=4, layers=2, n_pos=64, pad=1):
        super().__init__(vocab, d, h, layers, None, n_pos + pad + 1)
        self.pad = pad

    def forward(self, idx):
        mask = idx.ne(self.pad).int()
        pos = (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + self.pad
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def counted_pos_gpt():
    """Its head never picks the pad id (a generated pad would not advance the count in a full
    recompute, but does in a cached step, in Hugging Face's models as here)."""
    torch.manual_seed(0)
    model = CountedPosGPT().eval()
    with torch.no_grad():
        model.head.bias[model.pad] = -100.0
    return model
