"""The layout rules around attention: what they must absorb, and what they must leave alone."""

import torch
from pipeline_check import compile_and_prove
from torch import nn

from tfgraph import from_module
from tfgraph.exporters.compile import count_fusions, run_pipeline
from tfgraph.passes.recognize.attention.fuse import FuseAttentionPass
from tfgraph.sources.trace import trace

HQ, HKV, D = 8, 2, 8


class KV(nn.Module):
    """Attention over K/V heads expanded either as repeat_interleave (GQA: query head h uses
    KV head h // g) or tile-wise (query head h uses KV head h % g): only the first is GQA."""

    input_names = ("q", "k", "v")
    output_names = ("y",)

    def __init__(self, interleave: bool) -> None:
        super().__init__()
        self.interleave = interleave

    def _expand(self, x):
        b, h, s, d = x.shape
        g = HQ // HKV
        if self.interleave:
            return x[:, :, None].expand(b, h, g, s, d).reshape(b, h * g, s, d)
        return x[:, None].expand(b, g, h, s, d).reshape(b, g * h, s, d)

    def forward(self, q, k, v):
        k, v = self._expand(k), self._expand(v)
        return torch.softmax(q @ k.transpose(-2, -1) / D**0.5, dim=-1) @ v

    def example_inputs(self, batch, seq, generator):
        return {
            "q": torch.randn(batch, HQ, seq, D, generator=generator),
            "k": torch.randn(batch, HKV, seq, D, generator=generator),
            "v": torch.randn(batch, HKV, seq, D, generator=generator),
        }

    def dynamic_axes(self):
        return {n: {0: "batch", 2: "sequence"} for n in self.input_names}


def _kv_heads(module):
    model = trace(from_module(module))
    run_pipeline(model, "cleanup")
    assert FuseAttentionPass()(model).modified
    (node,) = [n for n in model.graph if n.domain == "tfgraph"]
    return node.attributes["kv_num_heads"].value


def test_repeat_interleave_is_absorbed_as_gqa():
    assert _kv_heads(KV(interleave=True)) == HKV


def test_tile_order_is_not_mistaken_for_gqa(tmp_path):
    assert _kv_heads(KV(interleave=False)) == HQ  # expansion kept: still exact
    source = from_module(KV(interleave=False))
    for target in ("ort", "onnx"):
        traced = trace(source, opset=20 if target == "ort" else 23)
        result = compile_and_prove(source, traced, "default", target, tmp_path)
        assert result["parity"]["passed"], result["parity"]["outputs"]
        attention = result["fusions"]["attention"]
        assert attention["fused"] == attention["total"] == 1


class PreScaledExtra(nn.Module):
    """Q pre-scaled and an extra additive score term before the softmax's scale: the rule
    cannot say which factor the extra term should get, so it refuses with that reason."""

    input_names = ("q", "k", "v")
    output_names = ("y",)

    def forward(self, q, k, v):
        scores = (q * 0.5) @ k.transpose(-2, -1) + q.sum(-1, keepdim=True)
        return torch.softmax(scores / 2.0, dim=-1) @ v

    def example_inputs(self, batch, seq, generator):
        return {n: torch.randn(batch, 4, seq, D, generator=generator) for n in "qkv"}

    def dynamic_axes(self):
        return {n: {0: "batch", 2: "sequence"} for n in "qkv"}


def test_extra_term_with_prescaled_q_is_reported():
    model = trace(from_module(PreScaledExtra()))
    run_pipeline(model, "cleanup")
    assert not FuseAttentionPass()(model).modified
    missed = count_fusions(model)["attention"]["missed"]
    assert len(missed) == 1
    assert "extra score term with Q or K pre-scaled" in missed[0]["reason"], missed
