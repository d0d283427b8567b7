"""Rotary embeddings written with complex numbers (``torch.polar``, ``view_as_complex``): the
trace computes them as real pairs (:mod:`tfgraph.sources.complex_rotary`), attention fuses,
parity holds, and the KV cache generates what eager recompute generates."""

from __future__ import annotations

import complex_rope_models
import pytest
import torch

import tfgraph
from tfgraph.runtime import CachedDecoder, Session
from tfgraph.sources import complex_rotary, from_module
from tfgraph.verify.generation_parity import compare_greedy


def test_pairs_compute_the_complex_product():
    torch.manual_seed(0)
    x, y = torch.randn(3, 5, 2), torch.randn(3, 5, 2)
    want = torch.view_as_real(torch.view_as_complex(x) * torch.view_as_complex(y))
    got = (complex_rotary.Pair(x) * complex_rotary.Pair(y)).t
    torch.testing.assert_close(got, want)
    pair = complex_rotary.Pair(x)
    assert pair.shape == (3, 5) and pair.unsqueeze(1).shape == (3, 1, 5)
    assert pair[:, None, :].shape == (3, 1, 5) and pair[..., 1:].shape == (3, 4)
    with pytest.raises(complex_rotary.ComplexTraceError, match="conj"):
        pair.conj()


# slow: polar_lm (40 s); meta_lm's complex rotation stays in the default tier
@pytest.mark.parametrize("factory", ["meta_lm", pytest.param("polar_lm", marks=pytest.mark.slow)])
def test_complex_rope_exports_fuses_and_caches(factory, tmp_path):
    model = getattr(complex_rope_models, factory)()
    source = from_module(model, origin=f"complex:{factory}")
    result = tfgraph.export(source, tmp_path / "art", kv_cache=True)
    assert result.report["parity"]["passed"], result.report["parity"]["outputs"]
    assert result.report["parity"]["decode"]["max_abs_err"] < 1e-4
    attention = result.report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == 2, attention["missed"]
    assert not any(
        vars(m).get("forward") for m in model.modules()
    )  # eager code restored after the trace
    assert complex_rope_models.apply_rotary_emb.__globals__["torch"] is torch
    decoder = CachedDecoder(Session(tmp_path / "art"))
    comparison = compare_greedy(source, decoder, [[5, 9, 2, 7], [3, 4, 8, 6]], 10)
    assert comparison.passed, (comparison.tokens, comparison.want_tokens)
