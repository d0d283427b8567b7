"""Q/K/V projections packed into one MatMul feeding GroupQueryAttention's packed form.

Qwen2 (separate q/k/v Linears with biases, GQA 4:2, RoPE) gets one MatMul + one bias Add per
layer; GPT-2 (one ``c_attn`` split in three) feeds the tensor before the ``Split``. Checked by
the graph (empty key/value inputs, MatMul counts) and by parity and greedy tokens against
eager PyTorch."""

import collections

import onnx
import pytest
import torch

import tfgraph
from tests.e2e.test_generation_parity import PAD
from tfgraph.runtime import CachedDecoder, Session
from tfgraph.sources import load_source
from tfgraph.verify.generation_parity import compare_greedy


def _save(tmp_path, cls: str, config) -> str:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    getattr(transformers, cls)(config).eval().save_pretrained(tmp_path / "hf")
    return str(tmp_path / "hf")


def _export(source, tmp_path):
    result = tfgraph.export(source, tmp_path / "a", kv_cache=True)
    parity = result.report["parity"]
    assert parity["prefill"]["passed"] and parity["decode"]["passed"], parity["outputs"]
    assert max(parity["prefill"]["max_abs_err"], parity["decode"]["max_abs_err"]) < 1e-4
    model = onnx.load(tmp_path / "a" / "model.onnx")
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    return model, gqa


def test_qwen2_projections_with_biases_become_one_matmul(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
    )  # fmt: skip
    source = _save(tmp_path, "Qwen2ForCausalLM", config)
    model, gqa = _export(source, tmp_path)
    assert len(gqa) == 2
    assert all(list(n.input[1:3]) == ["", ""] for n in gqa)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops["MatMul"] == 2 * 5 + 1, ops  # per layer: qkv, o, gate, up, down; the LM head
    weights = [i for i in model.graph.initializer if i.name.endswith("qkv_weight")]
    assert [tuple(w.dims) for w in weights] == [(64, 64 + 2 * 32)] * 2

    decoder = CachedDecoder(Session(tmp_path / "a"))
    prompts = [[5, 9, 14, 3, 8, 2, 7], [11, 4, 6]]
    comparison = compare_greedy(load_source(source), decoder, prompts, 12, pad=PAD)
    assert all(row["passed"] for row in comparison.steps), comparison.steps
    assert comparison.tokens == comparison.want_tokens


def test_gpt2_split_attention_projection_is_fed_unsplit(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=300, n_layer=2, n_embd=64, n_head=4)
    model, gqa = _export(_save(tmp_path, "GPT2LMHeadModel", config), tmp_path)
    assert len(gqa) == 2 and all(list(n.input[1:3]) == ["", ""] for n in gqa)
    assert not [n for n in model.graph.node if n.op_type == "Split"]
