"""Attention written the way older Hugging Face models write it: GPT-1's multiplicative causal
mask, DeBERTa's bmm layout with its disentangled relative term and ``XSoftmax``. Each module
must fuse into one ``tfgraph.Attention`` per layer and keep parity with eager PyTorch; each
rule's rejections leave the core unfused with the reason recorded."""

import math

import pytest
import torch
from pipeline_check import compile_and_prove
from torch import nn

import tfgraph.passes.recognize.attention.rules as attention_rules
from tfgraph import from_module
from tfgraph.exporters.compile import count_fusions, run_pipeline
from tfgraph.passes.recognize.attention.classify_bias import ClassifyAttentionBiasPass
from tfgraph.passes.recognize.attention.einsum import parse_batched_matmul
from tfgraph.passes.recognize.attention.fuse import FuseAttentionPass
from tfgraph.passes.rewrite_utils import diagnose
from tfgraph.sources.trace import trace

H, D, MAX = 4, 8, 128  # MAX: longer than any sequence parity tries


class _Heads(nn.Module):
    input_names = ("q", "k", "v")
    output_names = ("y",)

    def example_inputs(self, batch, seq, generator):
        return {n: torch.randn(batch, H, seq, D, generator=generator) for n in "qkv"}

    def dynamic_axes(self):
        return {n: {0: "batch", 2: "sequence"} for n in self.input_names}


class Gpt1(_Heads):
    """``OpenAIGPTAttention._attn``: ``w = w * b + -1e4 * (1 - b)`` with ``b`` a slice of a
    ``tril(ones)`` buffer (``keep`` turns the buffer's values from 0/1 to 0/2)."""

    def __init__(self, fill: float = -1e4, keep: float = 1.0) -> None:
        super().__init__()
        self.register_buffer("bias", keep * torch.tril(torch.ones(MAX, MAX)).view(1, 1, MAX, MAX))
        self.fill = fill

    def forward(self, q, k, v):
        w = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, nh, T, T)
        t = w.size(-1)
        b = self.bias[:, :, :t, :t]
        w = w * b + self.fill * (1 - b)
        return torch.softmax(w, dim=-1) @ v


class Deberta(_Heads):
    """``DisentangledSelfAttention`` (DeBERTa-v2, SEW-D): heads folded into the batch, Kᵀ
    scaled, a relative term from Q added before the (B, H, T, S) view, the padding mask
    selected in, and (``xsoftmax``) the masked probabilities zeroed again after the softmax."""

    input_names = ("q", "k", "v", "attention_mask")

    def __init__(self, xsoftmax: bool = True, same_mask: bool = True) -> None:
        super().__init__()
        self.rel = nn.Parameter(torch.randn(MAX, D) / D)
        self.xsoftmax, self.same_mask = xsoftmax, same_mask

    def forward(self, q, k, v, attention_mask):
        b, h, t, d = q.shape
        q3, k3, v3 = (x.reshape(-1, t, d) for x in (q, k, v))  # (B·nh, T, hs)
        scale = math.sqrt(d * 2)
        scores = torch.bmm(q3, k3.transpose(-1, -2) / scale)
        scores = scores + q3 @ self.rel[:t].t() / scale  # a c2p-like term from Q
        scores = scores.view(-1, h, t, t)  # (B, nh, T, T)
        drop = ~attention_mask.bool()[:, None, None, :]
        probs = torch.softmax(scores.masked_fill(drop, torch.finfo(q.dtype).min), dim=-1)
        if self.xsoftmax:
            other = drop if self.same_mask else ~drop
            probs = probs.masked_fill(other, 0.0)
        y3 = torch.bmm(probs.view(-1, t, t), v3)  # (B·nh, T, hs)
        return y3.view(-1, h, t, d)

    def example_inputs(self, batch, seq, generator):
        inputs = super().example_inputs(batch, seq, generator)
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[0, -2:] = 0  # a padded sample
        return {**inputs, "attention_mask": mask}

    def dynamic_axes(self):
        return {**super().dynamic_axes(), "attention_mask": {0: "batch", 1: "sequence"}}


def _fuse(module):
    model = trace(from_module(module))
    run_pipeline(model, "cleanup")
    FuseAttentionPass()(model)
    assert not FuseAttentionPass()(model).modified  # a second run finds nothing to do
    return model


def _attention(model):
    return [n for n in model.graph if n.domain == "tfgraph" and n.op_type == "Attention"]


def _proven(module, tmp_path):
    source = from_module(module)
    result = compile_and_prove(source, trace(source), "default", "ort", tmp_path)
    assert result["parity"]["passed"], result["parity"]["outputs"]
    attention = result["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == 1, attention
    return result


def test_gpt1_multiplicative_mask_is_causal(tmp_path):
    model = _fuse(Gpt1())
    (node,) = _attention(model)
    ClassifyAttentionBiasPass()(model)
    attrs = {k: v.value for k, v in node.attributes.items()}
    assert attrs["causal"] == 1 and attrs["bias_kind"] == "none" and len(node.inputs) == 3
    assert attrs["scale"] == pytest.approx(1 / math.sqrt(D))
    _proven(Gpt1(), tmp_path)


@pytest.mark.parametrize(
    "module, reason",
    [
        (Gpt1(fill=-1.0), "not a constant ≤ -1e4"),
        (Gpt1(keep=2.0), "not a constant of 0s and 1s"),
    ],
)
def test_gpt1_mask_rejections(module, reason):
    model = _fuse(module)
    assert not _attention(model)
    add = next(n for n in model.graph if n.op_type == "Softmax").inputs[0].producer()
    rules = [r for r in attention_rules.MASK_RULES if "MultiplicativeMask" in r.name]
    assert reason in diagnose(model, rules, add, depth=0)


def test_deberta_bmm_layout_with_relative_term(tmp_path):
    model = _fuse(Deberta())
    (node,) = _attention(model)
    attrs = {k: v.value for k, v in node.attributes.items()}
    assert attrs["num_heads"] == H and attrs["scale"] == pytest.approx(1 / math.sqrt(2 * D))
    assert len(node.inputs) == 4  # the relative term and the padding mask: one bias
    result = _proven(Deberta(), tmp_path)
    assert result["ops"]["Where"] == 1  # the padding mask's; XSoftmax's zeroing is gone


def test_deberta_without_xsoftmax(tmp_path):
    _proven(Deberta(xsoftmax=False), tmp_path)


def test_probabilities_zeroed_on_another_condition_are_kept():
    model = _fuse(Deberta(same_mask=False))
    assert not _attention(model)
    (missed,) = count_fusions(model)["attention"]["missed"]
    zeroing = next(n for n in model.graph if n.op_type == "Softmax").outputs[0].uses()[0].node
    rules = [r for r in attention_rules.MASK_RULES if "ZeroMaskedProbs" in r.name]
    assert "not masked on the same condition" in diagnose(model, rules, zeroing, depth=0)


class EinsumAttention(_Heads):
    """``CvtSelfAttention``: both contractions written with ``torch.einsum``; ``bad`` puts a
    permuted output on the second one (not a plain matrix product: left alone)."""

    def __init__(self, bad: bool = False) -> None:
        super().__init__()
        self.bad = bad

    def forward(self, q, k, v):
        scores = torch.einsum("bhlk,bhtk->bhlt", q, k) * D**-0.5
        probs = torch.softmax(scores, dim=-1)
        if self.bad:
            return torch.einsum("bhlt,bhtv->blhv", probs, v)
        return torch.einsum("bhlt,bhtv->bhlv", probs, v)


def test_einsum_attention_fuses(tmp_path):
    (node,) = _attention(_fuse(EinsumAttention()))
    assert node.attributes["scale"].value == pytest.approx(D**-0.5)
    result = _proven(EinsumAttention(), tmp_path)
    assert "Einsum" not in result["ops"]


def test_einsum_with_a_permuted_output_fuses(tmp_path):
    """The product written straight into (b, l, h, v): a MatMul, then a Transpose."""
    assert len(_attention(_fuse(EinsumAttention(bad=True)))) == 1
    result = _proven(EinsumAttention(bad=True), tmp_path)
    assert "Einsum" not in result["ops"]


@pytest.mark.parametrize(
    "equation, layout",
    [
        ("bhlk,bhtk->bhlt", ([0, 1, 2, 3], [0, 1, 3, 2], [0, 1, 2, 3])),
        ("bhlt,bhtv->bhlv", ([0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3])),
        ("bhkl,bhkt->bhlt", ([0, 1, 3, 2], [0, 1, 2, 3], [0, 1, 2, 3])),
        ("bhlt,bhtv->blhv", ([0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 1, 3])),  # permuted output
        ("bhud,uvhd->bhuv", None),  # Shaw's relative term: batch axes reordered
        ("bhlk,bhtk->bhtl", ([0, 1, 2, 3], [0, 1, 3, 2], [0, 1, 3, 2])),
        ("bhlk,bhlk->bhl", None),  # no free letter on either side
        ("bhlk,bhtk,bhtk->bhlt", None),  # three operands
        ("...lk,...tk->...lt", None),  # ``...`` without the ranks
    ],
)
def test_batched_matmul_equations(equation, layout):
    assert parse_batched_matmul(equation) == layout


def test_ellipsis_is_written_out_from_the_ranks():
    """LongT5's local attention: (batch, blocks, q, heads, d) by (batch, blocks, k, heads, d)."""
    perm_a, perm_b, perm_out = parse_batched_matmul("...qhd,...khd->...hqk", (5, 5))
    assert perm_a == [0, 1, 3, 2, 4] and perm_b == [0, 1, 3, 4, 2] and perm_out == [0, 1, 2, 3, 4]
    assert parse_batched_matmul("...qhd,...khd->...hqk", (5, 4)) is None
