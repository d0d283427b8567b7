"""Qwen4-Exp's QSA indexer selects each query's keys in a Python loop sized by the visible keys
(``torch.nonzero``; ``if num_complete_blocks > 0`` branches on tensor values). While tracing it
selects them with dense masked tensors (:mod:`tfgraph.sources.block_indexer`): the same
selection, and the model exports with parity (tiny config, built offline)."""

from __future__ import annotations

import pytest
import torch

import tfgraph
from tfgraph.sources import block_indexer

transformers = pytest.importorskip("transformers")
coverage = pytest.importorskip("tfgraph.tools.coverage")
pytest.importorskip("transformers.models.qwen4_exp")


def _model(**overrides):
    cls = transformers.Qwen4ExpForCausalLM
    config = coverage.config_for(cls, coverage.tiny_config("qwen4_exp_text", "causal-lm"))
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return cls(config).eval()


def _indexer(model):
    found = [m for m in model.modules() if block_indexer._is_block_indexer(m)]
    assert found
    return found[0]


def _inputs(indexer, batch, queries, keys, pads, additive):
    """Inputs of ``_select_tokens`` with every score positive and distinct (no ties for
    ``topk`` to break either way): the last ``queries`` of ``keys`` positions, causal, each
    batch row left-padded by ``pads[b]``."""
    heads, dim = indexer.index_n_heads, indexer.index_head_dim
    g = torch.Generator().manual_seed(keys * 7 + queries)
    q = torch.rand(batch, queries, heads, dim, generator=g) + 0.5
    raw_keys = torch.rand(batch, keys, dim, generator=g) + 0.5
    cos = 0.9 + 0.1 * torch.rand(batch, keys, dim // 2, generator=g)  # partial rotary
    sin = 0.1 * torch.rand(batch, keys, dim // 2, generator=g)
    positions = torch.arange(keys)
    causal = positions[None, :] <= positions[keys - queries :, None]  # [Q, K]
    padding = positions[None, :] >= torch.tensor(pads)[:, None]  # [B, K]
    mask = (causal[None] & padding[:, None])[:, None]  # [B, 1, Q, K]
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    hidden = torch.zeros(batch, queries, 8)
    return hidden, q, raw_keys, cos, sin, mask


@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize(
    "queries, keys, pads",
    [
        (3, 3, [0, 1]),  # no complete block
        (9, 9, [0, 2]),  # fewer complete blocks than block_topk
        (40, 40, [0, 13]),  # top-k among up to 10 blocks
        (33, 64, [5, 0]),  # queries after cached keys
        (1, 50, [0, 7]),  # one decoding step
    ],
)
def test_dense_selection_is_the_models(queries, keys, pads, additive):
    indexer = _indexer(_model())
    args = _inputs(indexer, 2, queries, keys, pads, additive)
    want = indexer._select_tokens(*args)
    got = block_indexer.select_tokens(indexer, *args)
    assert got.dtype == want.dtype == torch.bool and got.shape == want.shape
    assert torch.equal(got, want)
    visible = args[-1] == 0 if additive else args[-1]
    if keys >= 40:  # more complete blocks than block_topk: the selection drops keys
        assert (got.sum(-1) < visible.sum(-1)).any()


def test_substituted_only_within_the_block():
    model = _model()
    with block_indexer.substituted(model) as found:
        assert found == ["model.layers.1.self_attn.indexer"]
        assert "_select_tokens" in vars(_indexer(model))
    assert not any("_select_tokens" in vars(m) for m in model.modules())


# slow: 36 s (architecture coverage); the selection's own tests stay
@pytest.mark.slow
def test_exports_with_parity(tmp_path):
    """Parity shapes (2, 33) have 8 complete blocks for the last queries: the top 4 are kept."""
    model = _model()
    model.save_pretrained(tmp_path / "hf")
    report = tfgraph.export(str(tmp_path / "hf"), tmp_path / "out").report
    assert report["parity"]["passed"], report["parity"]["outputs"]
    attention = report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == 1, attention.get("missed")


# slow: 23 s (architecture coverage); the selection's own tests stay
@pytest.mark.slow
def test_its_cache_is_refused_with_the_reason(tmp_path):
    """The indexer pools its keys into blocks of ``compress_ratio`` along the key axis (an
    axis of ``sequence // 4 + 1``): the KV cache pass cannot carry that, and says so rather
    than writing a graph whose blocks stop at the new tokens."""
    from tfgraph.errors import TfgraphError

    _model().save_pretrained(tmp_path / "hf")
    with pytest.raises(TfgraphError, match="keys pooled into blocks"):
        tfgraph.export(str(tmp_path / "hf"), tmp_path / "out", kv_cache=True)
    assert not (tmp_path / "out").exists()
