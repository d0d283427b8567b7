"""Attention written the way later-covered Hugging Face models write it: SpeechT5's bmm layout
with a relative position term computed from Q; WavLM's ``F.multi_head_attention_forward`` and
Hiera's windows (heads never split out of the batch); T5Gemma's soft-capped encoder and cross
attention. Each module must fuse and keep parity with eager PyTorch."""

import onnx_ir as ir
import pytest
import torch
from pipeline_check import compile_and_prove
from torch import nn

import tfgraph.passes.recognize.attention.rules as attention_rules
from tests.passes.recognize.attention.test_attention_rules_more import (  # noqa: E402
    D,
    H,
    _attention,
    _Heads,
    _proven,
)
from tfgraph import from_module
from tfgraph.exporters.compile import run_pipeline
from tfgraph.passes.recognize.attention.fuse import FuseAttentionPass
from tfgraph.passes.rewrite_utils import diagnose
from tfgraph.sources.trace import trace

MAX = 64  # longer than any sequence parity tries


class SpeechT5(_Heads):
    """``SpeechT5Attention`` with ``SpeechT5RelativePositionalEncoding``: Q scaled before, heads
    folded into the batch, ``q·pos_kᵀ`` (pos_k (T, T, d)) added to the bmm, the mask added on
    a (B, H, T, S) view and the scores viewed back for the softmax."""

    input_names = ("q", "k", "v", "attention_mask")

    def __init__(self, masked: bool = True) -> None:
        super().__init__()
        self.pe_k = nn.Embedding(2 * MAX, D)
        self.masked = masked

    def forward(self, q, k, v, attention_mask):
        b, h, t, d = q.shape
        q3, k3, v3 = (x.reshape(b * h, -1, d) for x in (q * d**-0.5, k, v))  # (B·nh, T, hs)
        pos = torch.arange(t)
        pos_k = self.pe_k((pos[:, None] - pos[None, :]).clamp(-MAX, MAX - 1) + MAX)  # (T, T, hs)
        w = torch.bmm(q3, k3.transpose(1, 2))  # (B·nh, T, S)
        rel = torch.matmul(q3.transpose(0, 1), pos_k.transpose(-2, -1))  # (T, B·nh, T)
        w += rel.transpose(0, 1).view(b * h, t, t)
        if self.masked:
            mask = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(q.dtype).min
            w = (w.view(b, h, t, t) + mask).view(b * h, t, t)
        y3 = torch.bmm(torch.softmax(w, dim=-1), v3)  # (B·nh, T, hs)
        return y3.view(b, h, t, d)

    def example_inputs(self, batch, seq, generator):
        inputs = super().example_inputs(batch, seq, generator)
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[0, -2:] = 0  # a padded sample
        return {**inputs, "attention_mask": mask}

    def dynamic_axes(self):
        return {**super().dynamic_axes(), "attention_mask": {0: "batch", 1: "sequence"}}


# slow: 12 s on SpeechT5 (architecture coverage)
@pytest.mark.slow
def test_speecht5_relative_term_joins_the_bias(tmp_path):
    for masked in (True, False):
        model = trace(from_module(SpeechT5(masked)))
        run_pipeline(model, "cleanup")
        FuseAttentionPass()(model)
        (node,) = _attention(model)
        assert node.attributes["scale"].value == 1.0  # the scale is in Q
        assert len(node.inputs) == 4  # q·rᵀ (and the mask): one bias
        _proven(SpeechT5(masked), tmp_path)


class TorchMha(_Heads):
    """``F.multi_head_attention_forward`` with ``need_weights=True`` (WavLM): heads folded
    into the batch and never split out again, Q scaled, the gated position bias added by
    ``baddbmm``; the output leaves through (T, B, E)."""

    def __init__(self) -> None:
        super().__init__()
        self.rel = nn.Parameter(torch.randn(H, MAX, MAX))

    def forward(self, q, k, v):
        b, h, t, d = q.shape
        q3, k3, v3 = (x.reshape(b * h, t, d) for x in (q, k, v))  # (B·nh, T, hs)
        bias = self.rel[None, :, :t, :t].expand(b, h, t, t).reshape(b * h, t, t)
        w = torch.baddbmm(bias, q3 * d**-0.5, k3.transpose(-2, -1))  # (B·nh, T, S)
        y3 = torch.bmm(torch.softmax(w, dim=-1), v3)  # (B·nh, T, hs)
        return y3.transpose(0, 1).reshape(t, b, h * d)  # (T, B, E)


class Windowed(_Heads):
    """``HieraMaskUnitAttention``: (B, nh, windows, T, hs), Q scaled, no bias."""

    W = 2

    def example_inputs(self, batch, seq, generator):
        return {n: torch.randn(batch, H, self.W, seq, D, generator=generator) for n in "qkv"}

    def dynamic_axes(self):
        return {n: {0: "batch", 3: "sequence"} for n in self.input_names}

    def forward(self, q, k, v):
        w = (q * D**-0.5) @ k.transpose(-1, -2)  # (B, nh, W, T, S)
        return w.softmax(dim=-1) @ v


def test_heads_folded_into_the_batch_fuse_on_one_head_views(tmp_path):
    for module in (TorchMha(), Windowed()):
        model = trace(from_module(module))
        run_pipeline(model, "cleanup")
        FuseAttentionPass()(model)
        (node,) = _attention(model)
        assert node.attributes["num_heads"].value == 1
        assert node.attributes["scale"].value == pytest.approx(D**-0.5)
        _proven(module, tmp_path)


def test_bmm_with_a_head_view_keeps_its_heads():
    model = trace(from_module(SpeechT5()))
    run_pipeline(model, "cleanup")
    FuseAttentionPass()(model)
    (node,) = _attention(model)
    assert node.attributes["num_heads"].value == H  # not the flat rules' one head


def test_flat_rules_reject_broadcast_leading_dims():
    model = trace(from_module(Windowed()))
    run_pipeline(model, "cleanup")
    matmul = next(n for n in model.graph if n.op_type == "MatMul")
    k_t = matmul.inputs[1]
    k_t.shape = ir.Shape([1, *k_t.shape[1:]])  # as if K were shared over the batch
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    reason = diagnose(model, attention_rules.FLAT_RULES, softmax, depth=3)
    assert "same leading dims" in reason


class CappedCross(nn.Module):
    """T5Gemma's encoder self-attention and its decoder's cross-attention: soft-capped
    scores (``cap · tanh(s / cap)``), not causal, the cross one over S ≠ T keys."""

    input_names = ("q", "k", "v", "kx", "vx")
    output_names = ("y", "yx")
    CAP = 5.0

    def example_inputs(self, batch, seq, generator):
        qkv = {n: 3 * torch.randn(batch, H, seq, D, generator=generator) for n in "qkv"}
        cross = {n: 3 * torch.randn(batch, H, seq + 3, D, generator=generator) for n in "kv"}
        return {**qkv, "kx": cross["k"], "vx": cross["v"]}

    def dynamic_axes(self):
        axes = {n: {0: "batch", 2: "sequence"} for n in "qkv"}
        return {**axes, "kx": {0: "batch", 2: "source"}, "vx": {0: "batch", 2: "source"}}

    def _attend(self, q, k, v):
        w = q @ k.transpose(-1, -2) * D**-0.5
        w = torch.tanh(w / self.CAP) * self.CAP
        return torch.softmax(w, dim=-1) @ v

    def forward(self, q, k, v, kx, vx):
        return self._attend(q, k, v), self._attend(q, kx, vx)


@pytest.mark.parametrize("opset, fused", [(20, 1), (23, 2)])
def test_softcap_lowers_to_kernels_that_take_it(tmp_path, opset, fused):
    source = from_module(CappedCross())
    result = compile_and_prove(source, trace(source, opset=opset), "default", "ort", tmp_path)
    assert result["parity"]["passed"], result["parity"]["outputs"]
    attention = result["fusions"]["attention"]
    assert attention["fused"] == fused and attention["total"] == 2, attention
    assert (
        result["ops"]["com.microsoft::GroupQueryAttention"] == 1
    )  # the self one: S == T, causal=0
    if opset < 23:
        (reason,) = attention["missed"]
        assert "no softcap" in reason["reason"] and "--opset 23" in reason["reason"]
    else:
        assert result["ops"]["Attention"] == 1  # the cross one: ONNX Attention-23
