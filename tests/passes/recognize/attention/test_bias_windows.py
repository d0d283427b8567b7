"""Sliding windows of every length are found (the fuzzer found windows ≥ 9 missed), and a mask
is only dropped after a long evaluation confirms it is exactly causal + window."""

import tempfile

import numpy as np
import pytest
import torch
from ort_run import run_onnx

import tfgraph
from tfgraph import from_module
from tfgraph.exporters.compile import run_pipeline
from tfgraph.models import build
from tfgraph.models import transformer as zoo_transformer
from tfgraph.models.config import ModelConfig
from tfgraph.passes.recognize.attention.classify_bias import (
    CHECKED_KEY,
    LONG_SIZE,
    ClassifyAttentionBiasPass,
    agree,
    mask_window,
)
from tfgraph.passes.recognize.attention.fuse import FuseAttentionPass
from tfgraph.runtime import CachedDecoder, Session
from tfgraph.sources.trace import trace
from tfgraph.verify.generation_parity import compare_greedy

NEG = float("-inf")


def _mask(t: int, window: int = 0) -> np.ndarray:
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    blocked = (j > i) | ((i - j >= window) if window else False)
    return np.where(blocked, NEG, 0.0).astype(np.float32)[None, None]


@pytest.mark.parametrize(("t", "window", "want"), [(9, 0, 0), (13, 5, 5), (9, 9, 0), (40, 1, 1)])
def test_mask_window_reads_causal_masks(t, window, want):
    assert mask_window(_mask(t, window)) == want


def test_mask_window_rejects_anything_else():
    gap = _mask(12, 0)
    gap[..., 8, 3] = NEG  # a hole inside the visible band
    finite = _mask(12, 0)
    finite[..., 5, 2] = 0.5  # a position bias, not a pure mask
    empty = _mask(12, 0)
    empty[..., 0, 0] = NEG  # a row with nothing visible
    future = _mask(12, 0)
    future[..., 2, 7] = 0.0  # a key after the query
    for bad in (gap, finite, empty, future, _mask(12, 0)[..., :11, :]):
        assert mask_window(bad) is None


def test_agree_allows_a_window_only_where_it_cannot_show():
    # window 9: plainly causal at length 9, windowed at 13 → window 9
    assert agree([_mask(9), _mask(13, 9)])["window"] == 9
    assert agree([_mask(9, 4), _mask(13, 4)])["window"] == 4
    # plainly causal at 13 but windowed (9) at 9 cannot be one mask
    assert agree([_mask(9, 5), _mask(13)])["bias_kind"] == "additive"
    assert agree([_mask(9, 5), _mask(13, 7)])["bias_kind"] == "additive"


def _window_model(window: int):
    cfg = ModelConfig(
        vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=128,
        positions="rope", sliding_window=window, ffn="relu",
    )  # fmt: skip
    return build(cfg).eval()


def _classified(module):
    model = trace(from_module(module))
    run_pipeline(model, "cleanup")
    FuseAttentionPass()(model)
    ClassifyAttentionBiasPass()(model)
    return [n for n in model.graph if n.domain == "tfgraph" and n.op_type == "Attention"]


# slow: the long-window check at three window sizes; 40 stays
@pytest.mark.parametrize(
    "window",
    [pytest.param(9, marks=pytest.mark.slow), pytest.param(12, marks=pytest.mark.slow), 40],
)
def test_windows_longer_than_the_short_lengths_are_found(window):
    nodes = _classified(_window_model(window))
    assert len(nodes) == 2
    for node in nodes:
        assert node.attributes["window"].value == window
        assert node.attributes["causal"].value == 1
        assert len(node.inputs) == 3  # the mask is dropped: the kernel applies it
        assert int(node.metadata_props[CHECKED_KEY]) >= LONG_SIZE - 2


def _onnx_logits(path, ids: torch.Tensor) -> np.ndarray:
    return run_onnx(path, ids.numpy())[0]


# slow (without a cache): 8 s; the cached case checks the same window past 40 tokens, cached
@pytest.mark.parametrize("kv_cache", [pytest.param(False, marks=pytest.mark.slow), True])
def test_window_40_export_matches_eager_beyond_the_window(tmp_path, kv_cache):
    """Before the fix a window of 40 was taken for plain causal attention and dropped: the
    export passed its short parity shapes and was wrong past 40 tokens."""
    module = _window_model(40)
    result = tfgraph.export(from_module(module), tmp_path / "w40", kv_cache=kv_cache)
    assert result.passed
    if kv_cache:
        return  # cache parity is in the report; generation parity is tested below
    ids = torch.randint(0, 64, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = module(ids).numpy()
    got = _onnx_logits(tmp_path / "w40" / "model.onnx", ids)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_window_9_is_kv_cached_and_generates_like_eager(tmp_path):
    source = from_module(_window_model(9))
    result = tfgraph.export(source, tmp_path / "w9", kv_cache=True)
    assert result.passed and result.report["kv_cache"]
    decoder = CachedDecoder(Session(tmp_path / "w9"))
    # 6 + 24 tokens: the window slides over 21 steps
    comparison = compare_greedy(source, decoder, [[1, 2, 3, 4, 5, 6], [7, 8, 9]], 24)
    assert comparison.passed, comparison.steps


# slow: 13 s (an HF model traced twice); the window rules' own tests stay
@pytest.mark.slow
def test_mask_not_confirmed_at_length_keeps_the_bias(monkeypatch):
    """A mask that is causal at short lengths but not at long ones (rows ≥ 50 cannot see key
    0) must not be dropped: the long check keeps the bias, and the export stays exact."""

    def odd_mask(T, device, *, window=None, dtype=torch.float32):
        i = torch.arange(T, device=device)[:, None]
        j = torch.arange(T, device=device)[None, :]
        blocked = (j > i) | ((j == 0) & (i >= 50))
        return torch.zeros(T, T, dtype=dtype).masked_fill(blocked, float("-inf"))

    monkeypatch.setattr(zoo_transformer, "causal_mask", odd_mask)
    module = _window_model(None)
    nodes = _classified(module)
    assert all(len(n.inputs) > 3 and n.attributes["bias_kind"].value == "additive" for n in nodes)
    with tempfile.TemporaryDirectory() as d:
        result = tfgraph.export(from_module(module), f"{d}/odd")
        assert result.passed
        ids = torch.randint(0, 64, (1, 70), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = module(ids).numpy()
        np.testing.assert_allclose(_onnx_logits(f"{d}/odd/model.onnx", ids), want, atol=1e-4)
