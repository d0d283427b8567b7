"""A recurrence written in the layer's own ``forward`` (MiniMax's lightning attention, a
Python loop over blocks of tokens): traced as one ``tfgraph.LinearAttention`` (gated, a
constant decay per head), so the graph holds past one block (torch.export would unroll the loop
for the example's length), cached, and generating what Hugging Face generates
(tfgraph/sources/recurrent_layers.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402

import tfgraph  # noqa: E402
from tfgraph.sources import recurrent_layers  # noqa: E402
from tfgraph.tools.coverage import config_for, tiny_config  # noqa: E402
from tfgraph.tools.coverage_generation import greedy_vs_hf  # noqa: E402

BLOCK = 8  # tokens per block: the parity shapes (7 and 33 tokens) span one and five blocks


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    cls = transformers.MiniMaxForCausalLM
    config = config_for(cls, tiny_config("minimax", "causal-lm"))
    config.block_size = BLOCK
    torch.manual_seed(0)
    model = cls(config).eval()
    work = tmp_path_factory.mktemp("minimax")
    model.save_pretrained(work / "hf")
    return work, model


def test_the_op_computes_the_block_loop(minimax):
    _, model = minimax
    ids = torch.randint(3, 90, (2, 4 * BLOCK - 3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with recurrent_layers.substituted(model) as taken:
            got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert taken == sum("linear" in t for t in model.config.layer_types) >= 1
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[1, 5:], want[1, 5:], atol=1e-5, rtol=1e-4)
    assert not any("forward" in vars(m) for m in model.modules())  # restored


# slow: 1.2 min on MiniMax (architecture coverage); the op's own test stays
@pytest.mark.slow
def test_lightning_attention_is_cached_and_generates(minimax):
    work, model = minimax
    result = tfgraph.export(str(work / "hf"), work / "cached", kv_cache=True, target="ort")
    fusions = result.report["fusions"]
    assert fusions["recurrent"]["fused"] == fusions["recurrent"]["total"] == 1
    assert fusions["attention"]["fused"] == fusions["attention"]["total"] == 1
    parity = result.report["parity"]
    assert parity["passed"] and parity["decode"]["passed"], parity["outputs"]
    tokens = greedy_vs_hf(work, model, "causal-lm")
    assert tokens["tokens_equal"], tokens
