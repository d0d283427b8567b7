"""Small transformers written the way third-party PyTorch libraries write them (issue 47):
factories for `export third_party_models:NAME` in tests, random weights, tiny sizes.

- :class:`KeywordMaskLM`: ``forward(x, pos=None, mask=None)``, optional keyword arguments
  before the mask; its examples are the dict ``{"x": …, "mask": …}``.
- :class:`RelPosLM`: a relative-position helper that buckets each distance in Python from the
  length as an int (``int(x.shape[1])``).
- :class:`LoopMaskLM`: a causal mask built in a Python loop over ``x.shape[1]``.
"""

import math

import torch
from torch import nn

VOCAB, DIM, HEADS = 64, 32, 4


class _Attention(nn.Module):
    """Multi-head self-attention with an additive bias (heads or broadcast, query, key)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, _ = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS) + bias
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, DIM))


class KeywordMaskLM(nn.Module):
    """A padding mask passed by keyword after an optional position argument."""

    def __init__(self, max_len: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos_emb = nn.Embedding(max_len, DIM)
        self.attn = _Attention()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x, pos=None, mask=None):
        h = self.tok(x)
        if pos is not None:
            h = h + self.pos_emb(pos)
        bias = torch.zeros(x.shape[0], 1, 1, x.shape[1])
        if mask is not None:
            bias = bias.masked_fill(~mask[:, None, None, :], -1e4)
        return self.head(h + self.attn(h, bias))


def keyword_mask_lm():
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (2, 7))
    return KeywordMaskLM().eval(), {"x": x, "mask": torch.ones(2, 7, dtype=torch.bool)}


class RelPositionBias(nn.Module):
    """A relative-position helper in the T5 style of small libraries: each distance bucketed
    in Python (``math.log`` past an exact range) from the length as an int, the buckets looked
    up in a learned table per head. (The same table built with numpy from ``int(n)`` does
    trace: torch.export's strict mode converts numpy calls to torch ops.)"""

    def __init__(self, exact: int = 4, max_distance: int = 16) -> None:
        super().__init__()
        self.exact, self.max_distance = exact, max_distance
        self.table = nn.Embedding(2 * (exact + 4) + 1, HEADS)

    def bucket(self, distance: int) -> int:
        magnitude = abs(distance)
        if magnitude >= self.exact:
            spread = math.log(magnitude / self.exact) / math.log(self.max_distance / self.exact)
            magnitude = min(self.exact + int(spread * 4), self.exact + 4)
        return magnitude * (1 if distance >= 0 else -1) + self.exact + 4

    def forward(self, n: int) -> torch.Tensor:
        buckets = [[self.bucket(j - i) for j in range(n)] for i in range(n)]
        return self.table(torch.tensor(buckets)).permute(2, 0, 1)  # heads, n, n


class RelPosLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.rel = RelPositionBias()
        self.attn = _Attention()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.tok(x)
        bias = self.rel(int(x.shape[1]))
        return self.head(h + self.attn(h, bias))


def relpos_lm():
    torch.manual_seed(0)
    return RelPosLM().eval(), {"x": torch.randint(0, VOCAB, (2, 12))}


class LoopMaskLM(nn.Module):
    """A causal mask filled row by row in a Python loop over the length."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.attn = _Attention()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.tok(x)
        mask = torch.zeros(x.shape[1], x.shape[1])
        for i in range(x.shape[1]):
            mask[i, i + 1 :] = -1e4
        return self.head(h + self.attn(h, mask))


def loop_mask_lm():
    torch.manual_seed(0)
    return LoopMaskLM().eval(), (torch.randint(0, VOCAB, (2, 10)),)
