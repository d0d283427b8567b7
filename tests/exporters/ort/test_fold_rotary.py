"""RoPE folded into GroupQueryAttention (``do_rotary``), and no layout round trips.

A Llama-style layer's rotation (``q·cos + rotate_half(q)·sin`` on Q and K, tables from the
positions) becomes ``do_rotary=1`` with cos/sin caches of ``max_positions`` rows; the kernels
read the projections directly; the layers' length subgraphs are computed once. Checked by
node counts and by parity against eager PyTorch (prefill and decode, left-padded rows in the
batch, which the kernel positions by cache slot), and by greedy tokens equal to eager."""

import collections

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import tfgraph
from tests.e2e.test_generation_parity import PAD
from tfgraph import from_module
from tfgraph.runtime import CachedDecoder, Session
from tfgraph.verify.generation_parity import compare_greedy


def _ops(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(path).graph.node)


def _hf_llama(tmp_path, head: int, layers: int = 2):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=4 * head, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(tmp_path / "hf")
    return str(tmp_path / "hf")


def _gqa_nodes(path):
    return [n for n in onnx.load(path).graph.node if n.op_type == "GroupQueryAttention"]


def _attribute(node, name, default=0):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name),
                default)  # fmt: skip


def test_hf_llama_rotation_runs_inside_the_kernel(tmp_path):
    source = _hf_llama(tmp_path, head=16, layers=3)
    result = tfgraph.export(source, tmp_path / "a", kv_cache=True)
    parity = result.report["parity"]
    assert parity["prefill"]["passed"] and parity["decode"]["passed"]
    assert parity["prefill"]["max_abs_err"] < 1e-4 and parity["decode"]["max_abs_err"] < 1e-4
    model = tmp_path / "a" / "model.onnx"
    nodes = _gqa_nodes(model)
    assert len(nodes) == 3 and all(_attribute(n, "do_rotary") == 1 for n in nodes)
    ops = _ops(model)
    assert ops["Cos"] == ops["Sin"] == ops["Neg"] == 0, ops
    # the kernels read one packed projection: no Reshape/Transpose left around them
    producers = {o: n.op_type for n in onnx.load(model).graph.node for o in n.output}
    for node in nodes:
        assert producers[node.input[0]] == "MatMul" and list(node.input[1:3]) == ["", ""]
    assert ops["Transpose"] == 0 and ops["Reshape"] == 0, ops
    # one length subgraph for the three layers
    assert ops["Shape"] <= 3, ops
    cache = onnx.numpy_helper.to_array(
        next(i for i in onnx.load(model).graph.initializer if i.name.endswith("cos_cache"))
    )
    assert cache.shape == (256, 8)

    decoder = CachedDecoder(Session(tmp_path / "a"))
    prompts = [[5, 9, 14, 3, 8, 2, 7], [11, 4, 6]]  # the second row is left-padded
    comparison = compare_greedy(tfgraph.sources.load_source(source), decoder, prompts, 12, pad=PAD)
    assert all(row["passed"] for row in comparison.steps), comparison.steps
    assert comparison.tokens == comparison.want_tokens


def test_head_size_not_a_multiple_of_16_keeps_the_rotation_in_the_graph(tmp_path, caplog):
    source = _hf_llama(tmp_path, head=8)
    with caplog.at_level("INFO", logger="tfgraph.exporters.ort.fold_rotary"):
        result = tfgraph.export(source, tmp_path / "a", kv_cache=True)
    assert result.report["parity"]["decode"]["passed"]
    model = tmp_path / "a" / "model.onnx"
    assert all(_attribute(n, "do_rotary") == 0 for n in _gqa_nodes(model))
    assert _ops(model)["Cos"] == 1
    assert "head size 8 is not a multiple of 16" in caplog.text


class RotaryLM(nn.Module):
    """A new user's Llama-ish decoder: no config (so no known max_positions), RoPE written
    inline with ``torch.cat((-x2, x1))``, SDPA with ``is_causal``."""

    def __init__(self, vocab=64, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, vocab, bias=False)
        head = d // heads
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head, 2) / head))

    @staticmethod
    def rotate(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def forward(self, input_ids):
        b, t = input_ids.shape
        h = self.emb(input_ids)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(h).chunk(3, -1))
        angles = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1) + h)


def test_a_model_without_max_positions_is_not_folded_and_says_why(tmp_path, caplog):
    torch.manual_seed(0)
    with caplog.at_level("INFO", logger="tfgraph.exporters.ort.fold_rotary"):
        result = tfgraph.export(from_module(RotaryLM().eval()), tmp_path / "a")
    assert result.passed
    assert result.report["fusions"]["attention"]["fused"] == 1
    assert _ops(tmp_path / "a" / "model.onnx")["Cos"] >= 1
    assert "max_positions is unknown" in caplog.text


def test_cos_cache_matches_torch(tmp_path):
    """The tables are cos/sin of float32 position × inv_freq products, as torch builds them."""
    source = _hf_llama(tmp_path, head=16)
    tfgraph.export(source, tmp_path / "a", kv_cache=True)
    model = onnx.load(tmp_path / "a" / "model.onnx")
    tables = {
        i.name.rsplit("_", 2)[-2]: onnx.numpy_helper.to_array(i)
        for i in model.graph.initializer
        if i.name.endswith(("cos_cache", "sin_cache"))
    }
    inv = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16)
    angles = torch.arange(256).float()[:, None] * inv[None, :]
    np.testing.assert_allclose(tables["cos"], angles.cos().numpy(), atol=1e-6)
    np.testing.assert_allclose(tables["sin"], angles.sin().numpy(), atol=1e-6)
