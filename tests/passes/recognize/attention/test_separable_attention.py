"""MobileViTV2's separable self-attention: ``sum(v · softmax(s, t), t)`` with the logits ``s``
given directly (one channel) is attention with one query of head size 1, K = s and V = v
(:mod:`tfgraph.passes.recognize.attention.separable`). Each module must fuse into one
``tfgraph.Attention`` (one head: the leading axes fold into the rows), lower to
``MultiHeadAttention`` on ``ort`` (Q/K head size 1, V head size d) and keep parity with eager
PyTorch within the fp32 tolerance (|ort − eager| ≤ 1e-4 + 1e-3·|eager|, and max |ort − eager|
< 1e-4, at (batch, tokens) = (1, 7) and (2, 33)); a softmax and a sum over different axes stay
apart, with the reason recorded."""

import pytest
import torch
from pipeline_check import compile_and_prove
from torch import nn

import tfgraph.passes.recognize.attention.separable as separable_attention_rules
from tests.passes.recognize.attention.test_attention_rules_more import _attention, _fuse
from tfgraph import from_module
from tfgraph.passes.rewrite_utils import diagnose
from tfgraph.sources.trace import trace

C, P = 8, 4  # channels (V's head size), pixels per patch


class Separable(nn.Module):
    """``MobileViTV2LinearSelfAttention``'s core on x (B, C, P, N), N the tokens (patches):
    a 1×1 projection to 1 + 2C channels, ``softmax`` of the first over N, the keys weighted
    and summed over N, times ``relu(values)``. ``probs_first``: ``p * k`` instead of
    ``k * p``; ``keepdim``: the sum keeps the token axis; ``softmax_dim``/``sum_dim``: other
    axes (not attention over the tokens: must not fuse)."""

    input_names = ("x",)
    output_names = ("y",)

    def __init__(self, probs_first=False, keepdim=True, softmax_dim=-1, sum_dim=-1, extra=()):
        super().__init__()
        conv = nn.Conv3d if extra else nn.Conv2d  # a 1×1 projection either way
        self.qkv = conv(C, 1 + 2 * C, 1)
        self.probs_first, self.keepdim = probs_first, keepdim
        self.softmax_dim, self.sum_dim = softmax_dim, sum_dim
        self.extra = tuple(extra)  # more static axes between the pixels and the tokens

    def example_inputs(self, batch, seq, generator):
        shape = (batch, C, P, *self.extra, seq)
        return {"x": 3 * torch.randn(*shape, generator=generator)}

    def dynamic_axes(self):
        return {"x": {0: "batch", 3 + len(self.extra): "sequence"}}

    def forward(self, x):
        qkv = self.qkv(x)
        query, key, value = torch.split(qkv, [1, C, C], dim=1)
        scores = torch.softmax(query, dim=self.softmax_dim)
        weighted = scores * key if self.probs_first else key * scores
        context = weighted.sum(dim=self.sum_dim, keepdim=True)
        if not self.keepdim:  # the sum without keepdim, broadcast back by unsqueeze
            context = weighted.sum(dim=self.sum_dim).unsqueeze(self.sum_dim)
        return torch.relu(value) * context


class Pooled(nn.Module):
    """Rank 3 (B, C, N): one logit per token, a softmax-weighted sum of the tokens (one head)."""

    input_names = ("x",)
    output_names = ("y",)

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Conv1d(C, 1, 1)

    def example_inputs(self, batch, seq, generator):
        return {"x": 3 * torch.randn(batch, C, seq, generator=generator)}

    def dynamic_axes(self):
        return {"x": {0: "batch", 2: "sequence"}}

    def forward(self, x):
        return (x * torch.softmax(self.score(x), dim=-1)).sum(-1)  # (B, C)


class MobileViTV2(nn.Module):
    """The real ``MobileViTV2LinearSelfAttention`` at the coverage matrix's tiny config."""

    input_names = ("x",)
    output_names = ("y",)

    def __init__(self) -> None:
        super().__init__()
        modeling = pytest.importorskip("transformers.models.mobilevitv2.modeling_mobilevitv2")
        from transformers import MobileViTV2Config

        config = MobileViTV2Config(patch_size=2, image_size=64, width_multiplier=0.25)
        self.attention = modeling.MobileViTV2LinearSelfAttention(config, embed_dim=16)

    def example_inputs(self, batch, seq, generator):
        return {"x": 3 * torch.randn(batch, 16, P, seq, generator=generator)}

    def dynamic_axes(self):
        return {"x": {0: "batch", 3: "sequence"}}

    def forward(self, x):
        return self.attention(x)


def _proven(module, tmp_path):
    source = from_module(module)
    result = compile_and_prove(source, trace(source), "default", "ort", tmp_path)
    assert result["parity"]["passed"], result["parity"]["outputs"]
    attention = result["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == 1, attention
    assert result["ops"]["com.microsoft::MultiHeadAttention"] == 1
    assert "Softmax" not in result["ops"] and "ReduceSum" not in result["ops"]
    worst = max(o["max_abs_err"] for o in result["parity"]["outputs"])
    assert worst < 1e-4, worst
    return result


@pytest.mark.parametrize(
    "module",
    [
        Separable(),
        Separable(probs_first=True),
        Separable(keepdim=False),
        Separable(extra=(3,)),  # (B, C, P, 3, N): more leading axes fold into the rows
        Pooled(),
    ],
    ids=["mobilevitv2-core", "probs-first", "no-keepdim", "rank5", "rank3"],
)
def test_separable_attention_fuses(tmp_path, module):
    (node,) = _attention(_fuse(module))
    attrs = {k: v.value for k, v in node.attributes.items()}
    assert attrs["num_heads"] == attrs["kv_num_heads"] == 1  # (B, P) folded into the rows
    assert attrs["scale"] == 1.0 and attrs["bias_kind"] == "none" and not attrs["causal"]
    q, k, v = node.inputs
    assert list(q.shape[1:]) == [1, 1, 1] and k.shape[1] == 1 and k.shape[3] == 1
    assert v.shape[1] == 1 and v.shape[3] == C  # V's head size: the value channels
    _proven(module, tmp_path)


def test_real_mobilevitv2_layer(tmp_path):
    module = MobileViTV2()
    (node,) = _attention(_fuse(module))
    assert node.inputs[2].shape[3] == 16  # embed_dim
    _proven(module, tmp_path)


@pytest.mark.parametrize(
    "module, reason",
    [
        (Separable(softmax_dim=-2), "not over the softmax's axis"),  # softmax over the pixels
        (Separable(sum_dim=-2), "not over the softmax's axis"),  # sum over the pixels
        (Separable(softmax_dim=1, sum_dim=1), "broadcast over 0 axes"),  # over the one channel
    ],
    ids=["softmax-over-pixels", "sum-over-pixels", "over-channels"],
)
def test_other_axes_do_not_fuse(tmp_path, module, reason):
    model = _fuse(module)
    assert not _attention(model)
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    assert reason in diagnose(model, separable_attention_rules.RULES, softmax, depth=2)
    source = from_module(module)  # still exact: the standard ops, left as they are
    result = compile_and_prove(source, trace(source), "default", "ort", tmp_path)
    assert result["parity"]["passed"], result["parity"]["outputs"]
    assert result["fusions"]["attention"]["fused"] == 0
