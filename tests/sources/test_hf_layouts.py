"""Hugging Face classes whose attention is written in a layout of its own, from their
directories (random init, offline): each fuses every attention layer with parity, and the
decoder is KV-cached and generates like eager.

- GPT-NeoX-Japanese: ``baddbmm`` from zeros over (B·H, T, d), the scores viewed back to 4-D
  and multiplied by a 4-D V
  (:class:`~tfgraph.passes.recognize.attention.rules.BatchedScoresAttentionRule`).
- MPNet: a relative-position bias and then the padding mask, two Adds
  (:class:`~tfgraph.passes.recognize.attention.rules.StackedBiasRule`).
- ConvBERT: its dynamic convolution's softmax over a 9-tap kernel is a gate, not attention
  (:func:`~tfgraph.passes.recognize.attention.fuse.is_gating_softmax`).
"""

from __future__ import annotations

import onnx_ir as ir
import pytest

import tfgraph
from tfgraph.runtime import CachedDecoder, Session
from tfgraph.sources import load_source
from tfgraph.verify.generation_parity import compare_greedy

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
)


def _saved(model, path):
    model.eval().save_pretrained(path)
    return str(path)


def _attention(result) -> tuple:
    entry = result.report["fusions"]["attention"]
    return entry["fused"], entry["total"], entry["missed"]


def test_gpt_neox_japanese_fuses_caches_and_generates_like_eager(tmp_path):
    config = transformers.GPTNeoXJapaneseConfig(**SMALL)
    path = _saved(transformers.GPTNeoXJapaneseForCausalLM(config), tmp_path / "hf")
    result = tfgraph.export(path, tmp_path / "art", kv_cache=True)
    assert _attention(result) == (2, 2, [])
    assert result.passed and result.report["parity"]["decode"]["passed"]
    decoder = CachedDecoder(Session(tmp_path / "art"))
    comparison = compare_greedy(load_source(path), decoder, [[5, 9, 2, 7], [3, 1, 4]], 8)
    assert comparison.passed, comparison.steps


def test_mpnet_relative_bias_and_mask_fuse_as_one_bias(tmp_path):
    config = transformers.MPNetConfig(**SMALL)
    path = _saved(transformers.MPNetForMaskedLM(config), tmp_path / "hf")
    result = tfgraph.export(path, tmp_path / "art")
    assert _attention(result) == (2, 2, [])
    assert result.passed
    model = ir.load(tmp_path / "art" / "model.onnx")
    assert not any(n.op_type == "Softmax" for n in model.graph)


def test_convbert_dynamic_convolution_kernel_is_a_gate(tmp_path):
    """The report counts the 2 self-attention layers only (2/2; it showed 2/4 with "expected
    Softmax, got Transpose"), and the kernels' 2 softmaxes stay."""
    config = transformers.ConvBertConfig(**SMALL, conv_kernel_size=9)
    path = _saved(transformers.ConvBertForMaskedLM(config), tmp_path / "hf")
    result = tfgraph.export(path, tmp_path / "art")
    assert _attention(result) == (2, 2, [])
    assert result.passed
    model = ir.load(tmp_path / "art" / "model.onnx")
    assert sum(n.op_type == "Softmax" for n in model.graph) == 2


@pytest.mark.parametrize(
    ("model_type", "shapes"),
    [
        # mel bins stated by the encoder's sub-config: both layouts, channels first first
        ("parakeet_ctc", {(2, 80, 64), (2, 64, 80)}),
        # features per frame under another name (Wav2Vec2-BERT's feature projection)
        ("wav2vec2-bert", {(2, 64, 160)}),
    ],
)
def test_speech_feature_sizes_from_sub_configs_and_other_names(model_type, shapes):
    import torch
    import transformers

    from tfgraph.sources.hf_layouts import candidates

    config = transformers.AutoConfig.for_model(model_type)
    made = candidates(torch.nn.Identity(), config, "input_features")
    got = {tuple(make(2, base, None).shape) for make, _axis, base in made if base == 64}
    assert shapes <= got, got
