"""Tiny text models with a tokenizer, built in memory (no download): a WordLevel tokenizer over
the words ``w0`` … ``w252`` (ids 3 …; 0 ``<unk>``, 1 ``<s>``, 2 ``</s>``), a random-init Llama
of 256 tokens, and a nanoGPT-style ``nn.Module`` that is not a transformers model."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256


def word_tokenizer():
    """A transformers fast tokenizer: whitespace-split words, one id each."""
    import tokenizers
    import transformers
    from tokenizers import models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    vocab = {w: i for i, w in enumerate(words)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="</s>",
    )  # fmt: skip


def tiny_llama(seed: int = 0):
    """A 2-layer Llama (GQA: 4 heads, 2 KV heads) of 256 tokens, random weights."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return transformers.LlamaForCausalLM(config).eval()


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """nanoGPT's shape in a few lines: what a notebook user writes (no tfgraph protocol)."""

    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2, positions: int = 128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(positions, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def tiny_gpt(seed: int = 0) -> TinyGPT:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return TinyGPT().eval()


def eager_greedy(model: nn.Module, ids: list[int], new: int, eos: int | None = None) -> list:
    """Up to ``new`` greedy tokens after ``ids`` by full forward passes of the eager model (no
    cache), ending at ``eos`` (included) when one is given."""
    tokens = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(new):
            logits = model(tokens)
            logits = getattr(logits, "logits", logits)
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            if eos is not None and tokens[0, -1] == eos:
                break
    return tokens[0, len(ids) :].tolist()
