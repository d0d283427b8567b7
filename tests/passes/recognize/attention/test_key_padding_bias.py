"""A padding bias that is exactly a key mask of ``attention_mask`` is rebuilt from the mask.

Hugging Face's masks (index grids, ``GatherND`` over the mask, ``And`` with the causal
pattern) become ``Unsqueeze(Where(Equal(mask, 0), lowest, 0))`` with ``causal`` on the kernel;
a bias that also carries position values (BLOOM's ALiBi) is left as it is. Parity against
eager PyTorch with a left-padded row in the batch, prefill and decode, shows it is the same
mask."""

import collections

import onnx
import pytest
import torch
from pipeline_check import assert_export_passed

import tfgraph

KEY_BIAS = "attention_mask__key_bias"


def _export(tmp_path, cls: str, config, kv_cache: bool = True):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    getattr(transformers, cls)(config).eval().save_pretrained(tmp_path / "hf")
    result = tfgraph.export(str(tmp_path / "hf"), tmp_path / "a", kv_cache=kv_cache)
    assert_export_passed(result, kv_cache)
    model = onnx.load(tmp_path / "a" / "model.onnx")
    values = {o for n in model.graph.node for o in n.output}
    return model, values, collections.Counter(n.op_type for n in model.graph.node)


# slow: without the cache (9 s); the cached graph, which keeps the same three ops, stays
@pytest.mark.parametrize("kv_cache", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_hf_mistral_mask_is_three_ops_on_the_mask(tmp_path, kv_cache):
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
        sliding_window=None,
    )  # fmt: skip
    model, values, ops = _export(tmp_path, "MistralForCausalLM", config, kv_cache)
    assert any(v.startswith(KEY_BIAS) for v in values), values  # (…__total once cached)
    assert ops["GatherND"] == 0 and ops["Range"] == 0 and ops["And"] == 0, ops
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(len(n.input) > 10 and n.input[10] for n in gqa)


# slow: 1 min (architecture coverage); the Mistral mask cases stay
@pytest.mark.slow
def test_a_bias_with_position_values_is_kept(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BloomConfig(vocab_size=300, hidden_size=64, n_layer=2, n_head=4)
    _, values, _ = _export(tmp_path, "BloomForCausalLM", config)
    assert not any(v.startswith(KEY_BIAS) for v in values)
