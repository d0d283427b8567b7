"""Attention recognition and bias classification (before lowering): what each layer became."""

import math

import pytest
import torch
from torch import nn

from tfgraph import from_module, load_source
from tfgraph.exporters.compile import count_fusions, run_pipeline
from tfgraph.passes.recognize.attention.classify_bias import ClassifyAttentionBiasPass
from tfgraph.passes.recognize.attention.fuse import FuseAttentionPass
from tfgraph.sources.trace import module_name, trace


def _fused(model):
    return [n for n in model.graph if n.domain == "tfgraph" and n.op_type == "Attention"]


def _recognize(source):
    model = trace(source)
    run_pipeline(model, "cleanup")
    assert FuseAttentionPass()(model).modified
    assert not FuseAttentionPass()(model).modified  # a second run finds nothing to do
    ClassifyAttentionBiasPass()(model)
    assert not ClassifyAttentionBiasPass()(model).modified
    return model


def _attrs(node):
    a = {k: v.value for k, v in node.attributes.items()}
    return (
        a["num_heads"],
        a["kv_num_heads"],
        a["causal"],
        a["window"],
        a["bias_kind"],
        len(node.inputs) > 3,
    )


# preset → per-layer (num_heads, kv_num_heads, causal, window, bias_kind, has_bias)
EXPECTED = {
    "gpt-tiny": [(4, 4, 1, 0, "none", False)] * 2,
    "llama-tiny": [(8, 2, 1, 0, "none", False)] * 2,
    "llama-tiny-sdpa": [(8, 2, 1, 0, "none", False)] * 2,
    "llama2-70b-tiny": [(64, 8, 1, 0, "none", False)] * 2,
    "palm-tiny": [(4, 1, 1, 0, "none", False)] * 2,
    "mistral-tiny": [(8, 2, 1, 8, "none", False)] * 2,
    "bloom-tiny": [(6, 6, 1, 0, "alibi", True)] * 2,
    "mpt-tiny": [(8, 8, 1, 0, "alibi", True)] * 2,
    "bert-tiny": [(4, 4, 0, 0, "padding", True)] * 2,
    "t5-tiny": [(4, 4, 0, 0, "padding", True)] * 2
    + [(4, 4, 1, 0, "relative", True), (4, 4, 0, 0, "padding", True)] * 2,
    # Shaw: the activation term q·r stays the bias; the causal mask added to it is split off
    "shaw-tiny": [(4, 4, 1, 0, "additive", True)] * 2,
}


# slow: per-layer attention fusion of eleven presets; llama-tiny and t5-tiny stay
@pytest.mark.parametrize(
    "name",
    [
        n if n in ("llama-tiny", "t5-tiny") else pytest.param(n, marks=pytest.mark.slow)
        for n in EXPECTED
    ],
)
def test_preset_layers(name):
    model = _recognize(load_source(name))
    nodes = _fused(model)
    expected = EXPECTED[name]
    assert [_attrs(n) for n in nodes] == expected
    attention = count_fusions(model)["attention"]
    assert attention["fused"] == attention["total"] == len(expected)
    assert all(module_name(n).endswith("attn") for n in nodes)


class Core(nn.Module):
    """One attention core on (B, H, T, d) inputs, with knobs to break each rule check."""

    input_names = ("q", "k", "v", "s")
    output_names = ("y",)

    def __init__(self, softmax_dim=-1, scale_from_input=False, guard_value=0.0):
        super().__init__()
        self.softmax_dim, self.scale_from_input = softmax_dim, scale_from_input
        self.guard_value = guard_value

    def forward(self, q, k, v, s):
        scores = q @ k.transpose(-2, -1)
        scores = scores * s.mean() if self.scale_from_input else scores / math.sqrt(8)
        p = torch.softmax(scores, dim=self.softmax_dim)
        if self.guard_value != 0.0:
            p = torch.where(torch.isnan(p), torch.tensor(self.guard_value), p)
        return p @ v

    def example_inputs(self, batch, seq, generator):
        q, k, v = (torch.randn(batch, 4, seq, 8, generator=generator) for _ in range(3))
        return {"q": q, "k": k, "v": v, "s": torch.ones(batch, 3)}

    def dynamic_axes(self):
        return {n: {0: "batch", 2: "sequence"} for n in "qkv"} | {"s": {0: "batch"}}


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"softmax_dim": 2}, "softmax over axis"),
        ({"scale_from_input": True}, "scale is not a constant scalar"),
        ({"guard_value": 1.0}, "NaN guard does not write 0"),
    ],
    ids=["softmax-axis", "non-constant-scale", "nan-guard"],
)
def test_rejections_name_their_reason(kwargs, reason):
    model = trace(from_module(Core(**kwargs)))
    run_pipeline(model, "cleanup")
    assert not FuseAttentionPass()(model).modified
    attention = count_fusions(model)["attention"]
    assert (attention["fused"], attention["total"]) == (0, 1)
    assert reason in attention["missed"][0]["reason"], attention["missed"]


def test_three_d_scores_fuse_on_one_head_or_are_reported():
    class Flat(nn.Module):  # heads folded into the batch, no 4-D view: one head per row
        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-2, -1) / 8, dim=-1) @ v

    g = torch.Generator().manual_seed(0)
    example = tuple(torch.randn(8, 6, 8, generator=g) for _ in range(3))
    model = trace(from_module(Flat(), example))
    run_pipeline(model, "cleanup")
    FuseAttentionPass()(model)
    (node,) = [n for n in model.graph if n.domain == "tfgraph" and n.op_type == "Attention"]
    assert node.attributes["num_heads"].value == 1
    # K and V (S, d) broadcast over Q's batch: no one-head view of all three
    example = (example[0], example[1][0], example[2][0])
    model = trace(from_module(Flat(), example))
    run_pipeline(model, "cleanup")
    FuseAttentionPass()(model)
    missed = count_fusions(model)["attention"]["missed"]
    assert len(missed) == 1 and "4-D" in missed[0]["reason"]
