"""The KV cache of a merged self/cross attention (T5Gemma 2's decoder: one softmax over the
decoder's own keys and the encoder's, ``K = Concat(k_self, k_enc)``): only the self part is
cached, the encoder part goes to the encoder graph as cross K/V (:mod:`passes.
merged_attention_cache`)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

import tfgraph
from tfgraph import contract
from tfgraph.passes.cache.merged_attention_cache import _masks_later_self_keys
from tfgraph.passes.recognize.attention.classify_bias import MASKED
from tfgraph.tools.coverage import config_for, tiny_config
from tfgraph.tools.coverage_generation import greedy_vs_hf

transformers = pytest.importorskip("transformers")


def _merged_bias(t: int, s: int, self_first: bool, causal: bool = True) -> np.ndarray:
    own = np.where(np.triu(np.ones((t, t), bool), k=1), -1e9, 0.0) if causal else np.zeros((t, t))
    enc = np.zeros((t, s))
    return np.concatenate([own, enc] if self_first else [enc, own], axis=-1)[None, None]


def test_the_self_block_must_mask_later_keys():
    assert _masks_later_self_keys(_merged_bias(5, 7, True), 0)
    assert _masks_later_self_keys(_merged_bias(5, 7, False), 1)
    assert not _masks_later_self_keys(_merged_bias(5, 7, True), 1)  # the wrong block
    assert not _masks_later_self_keys(_merged_bias(5, 7, True, causal=False), 0)
    assert MASKED > -1e9


@pytest.mark.skipif(
    not hasattr(transformers, "T5Gemma2ForConditionalGeneration"), reason="no T5Gemma 2"
)
# slow: 1.5 min on T5Gemma2 (architecture coverage)
@pytest.mark.slow
def test_t5gemma2_merged_attention_is_cached(tmp_path):
    import torch

    cls = transformers.T5Gemma2ForConditionalGeneration
    config = config_for(cls, tiny_config("t5gemma2", "seq2seq-lm"))
    torch.manual_seed(0)
    model = cls(config).eval()
    model.save_pretrained(tmp_path / "hf")
    result = tfgraph.export(str(tmp_path / "hf"), tmp_path / "cached", kv_cache=True)
    parity = result.report["parity"]
    assert parity["passed"], parity["outputs"]
    assert parity["prefill"]["passed"] and parity["decode"]["passed"]
    assert parity["decode"]["max_abs_err"] < 1e-4

    step = ir.load(tmp_path / "cached" / "model.onnx")
    roles = {r for r, _ in contract.read_roles(step.metadata_props).values()}
    assert {contract.PAST_KEY, contract.PRESENT_KEY, contract.CROSS_KEY} <= roles
    past = next(v for v in step.graph.inputs if v.name == "past_key_values.0.key")
    heads, size = config.decoder.num_key_value_heads, config.decoder.head_dim
    assert [d if isinstance(d, int) else str(d) for d in past.shape] == [
        "batch",
        heads,
        contract.PAST_DIM,
        size,
    ]
    encoder = ir.load(tmp_path / "cached" / "encoder.onnx")
    outputs = sorted(v.name for v in encoder.graph.outputs)
    layers = config.decoder.num_hidden_layers
    assert outputs == sorted(
        f"cross_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")
    )
    # a decoding step does not run the encoder: it reads at most the encoder length
    ids = [v for v in step.graph.inputs if v.name == "input_ids"]
    assert all(use.node.op_type == "Shape" for v in ids for use in v.uses())

    row = greedy_vs_hf(tmp_path, model, "seq2seq-lm")
    assert row["tokens_equal"], row


# slow: 23 s on T5Gemma2 (architecture coverage)
@pytest.mark.slow
@pytest.mark.skipif(
    not hasattr(transformers, "T5Gemma2ForConditionalGeneration"), reason="no T5Gemma 2"
)
def test_t5gemma2_static_cache_stays_copying(tmp_path):
    """The ``onnx`` target's static buffer pads the keys at their end: wrong where the
    encoder's keys follow the buffer, so the merged layers keep the copying cache."""
    import torch

    cls = transformers.T5Gemma2ForConditionalGeneration
    config = config_for(cls, tiny_config("t5gemma2", "seq2seq-lm"))
    torch.manual_seed(0)
    cls(config).eval().save_pretrained(tmp_path / "hf")
    result = tfgraph.export(str(tmp_path / "hf"), tmp_path / "art", kv_cache=True, target="onnx")
    parity = result.report["parity"]
    assert parity["passed"] and parity["decode"]["passed"], parity["outputs"]
    step = ir.load(tmp_path / "art" / "model.onnx")
    assert contract.KV_LAYOUT_KEY not in step.metadata_props
