"""Tracing the first layers and copying the rest (tfgraph.sources.replicate_layers): the graph
equals the full trace's node for node, layers that differ are traced whole, live parameters
are bound without a copy, and an export through the shortcut passes parity."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

import tfgraph
from tfgraph.models import ModelConfig, build
from tfgraph.sources import load_source, replicate_layers
from tfgraph.sources.loading import from_module
from tfgraph.sources.trace import trace

LAYERS = 8


def canonical(model) -> tuple:
    """The graph with value names taken out: each node's operator, attributes, output shapes
    and where each input comes from (a graph input or parameter by name, a constant by its
    bytes, another node by position); the outputs; the initializers."""
    graph = model.graph
    ids: dict = {v: ("input", v.name) for v in graph.inputs}
    for name, v in graph.initializers.items():
        if "." in name:  # a parameter: its module path
            ids[v] = ("parameter", name)
        else:  # a lifted constant, numbered by the exporter
            ids[v] = ("constant", hashlib.md5(v.const_value.tobytes()).hexdigest(), str(v.dtype))
    rows = []
    for k, node in enumerate(graph):
        for o, v in enumerate(node.outputs):
            ids[v] = ("node", k, o)
        attributes = tuple(sorted((a.name, str(a.value)) for a in node.attributes.values()))
        inputs = tuple(None if v is None else ids[v] for v in node.inputs)
        shapes = tuple(str(v.shape) for v in node.outputs)
        rows.append((node.domain, node.op_type, attributes, inputs, shapes))
    initializers = sorted(ids[v] + (str(v.shape),) for v in graph.initializers.values())
    return tuple(rows), tuple(ids[v] for v in graph.outputs), tuple(initializers)


def traced_both_ways(make_source, monkeypatch):
    monkeypatch.setenv(replicate_layers.OFF, "1")
    full_source = make_source()
    full = trace(full_source)
    monkeypatch.setenv(replicate_layers.OFF, "0")
    short_source = make_source()
    short = trace(short_source)
    return full, full_source, short, short_source


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    import transformers

    from tfgraph.tools.random_checkpoint import write_random_checkpoint

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return write_random_checkpoint(config, tmp_path_factory.mktemp("llama8") / "ckpt")


# slow: 40 s; the shortcut and PyTorch encoder cases stay in the default tier
@pytest.mark.slow
def test_streamed_checkpoint_graph_equals_the_full_trace(llama_checkpoint, monkeypatch):
    full, full_source, short, source = traced_both_ways(
        lambda: load_source(str(llama_checkpoint)), monkeypatch
    )
    assert source.info["traced_layers"] == f"4 of {LAYERS} in model.layers"
    assert "traced_layers" not in full_source.info
    assert canonical(short) == canonical(full)
    names = {n for n in short.graph.initializers if n.startswith("model.layers.7.")}
    assert len(names) == 7  # its 7 projections (transposed; the all-ones norms are shared)
    lazy = short.graph.initializers["model.layers.7.mlp.down_proj.weight__t"].const_value
    assert type(lazy).__name__ != "TorchTensor"  # a checkpoint tensor, not the traced storage


# slow: 15 s; the shortcut and PyTorch encoder cases stay in the default tier
@pytest.mark.slow
def test_live_module_graph_equals_the_full_trace_and_shares_parameters(monkeypatch):
    cfg = ModelConfig(family="decoder", vocab_size=128, d_model=32, n_layers=LAYERS, n_heads=4)
    module = build(cfg, seed=1)
    full, _, short, source = traced_both_ways(lambda: from_module(module), monkeypatch)
    assert source.info["traced_layers"] == f"4 of {LAYERS} in decoder.blocks"
    assert canonical(short) == canonical(full)
    copied = [n for n in short.graph.initializers if n.startswith(f"decoder.blocks.{LAYERS - 1}.")]
    assert copied
    params = dict(module.named_parameters())
    for name in copied:  # the module's own storage: bound, never copied
        raw = short.graph.initializers[name].const_value.raw
        if name in params:
            assert raw.data_ptr() == params[name].data_ptr()


class _Scaled(nn.Module):
    """A layer whose computation depends on its index (as GPT-2's
    ``scale_attn_by_inverse_layer_idx`` does): copies of one layer would be wrong."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.layer_idx = index
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.proj(x) / (self.layer_idx + 1)


class _Stack(nn.Module):
    def __init__(self, layers) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.layers = nn.ModuleList(layers)

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return h


def test_layer_that_depends_on_its_index_is_traced_whole(monkeypatch):
    torch.manual_seed(0)
    module = _Stack([_Scaled(i) for i in range(LAYERS)])
    assert replicate_layers.plan(module) is not None  # the modules alone look alike
    full, _, short, source = traced_both_ways(lambda: from_module(module), monkeypatch)
    assert "traced_layers" not in source.info  # the traced layers gave different constants
    assert canonical(short) == canonical(full)


def test_plan_takes_only_stacks_of_equal_layers():
    same = _Stack([_Scaled(i) for i in range(LAYERS)])
    found = replicate_layers.plan(same)
    assert found is not None and (found.path, found.count) == ("layers", LAYERS)
    odd = _Stack([_Scaled(i) for i in range(LAYERS)])
    odd.layers[6].proj = nn.Linear(8, 8, bias=False)  # one layer without a bias
    assert replicate_layers.plan(odd) is None
    flagged = _Stack([_Scaled(i) for i in range(LAYERS)])
    flagged.layers[5].sliding = True  # a setting only one layer has
    for i, layer in enumerate(flagged.layers):
        layer.sliding = i == 5
    assert replicate_layers.plan(flagged) is None
    short = _Stack([_Scaled(i) for i in range(replicate_layers.MIN_LAYERS - 1)])
    assert replicate_layers.plan(short) is None  # too few to be worth it


def test_export_through_the_shortcut_passes_parity(llama_checkpoint, tmp_path):
    result = tfgraph.export(str(llama_checkpoint), tmp_path / "out", kv_cache=True)
    assert result.report["source"]["traced_layers"] == f"4 of {LAYERS} in model.layers"
    assert result.report["parity"]["passed"]
    fused = result.report["fusions"]["attention"]
    assert (fused["fused"], fused["total"]) == (LAYERS, LAYERS)
    modules = [layer["module"] for layer in fused["fused_layers"]]  # copies keep their scopes
    assert [m.split("layers.")[-1] for m in modules] == [f"{i}.self_attn" for i in range(LAYERS)]
    cases = result.report["parity"]["cases"]
    assert {c["phase"] for c in cases} == {"prefill", "decode"}
    assert all(c["passed"] for c in cases)


class _TorchEncoderLM(nn.Module):
    """PyTorch's own ``nn.TransformerEncoder`` (its layers deep copies of one), causal."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(32, 100)

    def forward(self, tokens):
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.enc(self.emb(tokens), mask=mask, is_causal=True))


# slow: 16 s (two traces); the shortcut's export with parity stays in the default tier
@pytest.mark.slow
def test_torch_transformer_encoder_graph_equals_the_full_trace(monkeypatch):
    torch.manual_seed(0)
    module = _TorchEncoderLM().eval()
    example = (torch.randint(0, 100, (2, 9)),)
    full, _, short, source = traced_both_ways(lambda: from_module(module, example), monkeypatch)
    assert source.info["traced_layers"] == f"4 of {LAYERS} in enc.layers"
    assert canonical(short) == canonical(full)
