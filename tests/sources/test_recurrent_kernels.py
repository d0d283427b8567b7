"""The kernel entry points of Hugging Face's recurrent layers, traced as canonical ops
(tfgraph/sources/recurrent_kernels.py): each wrapper computes what the fallback it replaces
computes, the entry points are found by kernel name and put back after the block."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402

from tfgraph.sources import recurrent_kernels as rk  # noqa: E402
from tfgraph.tools.coverage import tiny_config  # noqa: E402

# model type → the kernel entry points its layers call (one layer of each kind, tiny)
MODELS = {
    "qwen3_next": {"causal_conv1d_fn", "chunk_gated_delta_rule"},  # Gated DeltaNet + attention
    "mamba": {"causal_conv1d_fn", "selective_scan_fn"},  # Mamba-1, per channel
    "bamba": {"causal_conv1d_fn", "mamba_chunk_scan_combined"},  # Mamba-2's SSD
}


def _tiny(model_type: str):
    torch.manual_seed(0)
    config = tiny_config(model_type, "causal-lm")
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_wrappers_compute_what_the_fallbacks_compute(model_type):
    model = _tiny(model_type)
    ids = torch.randint(3, 400, (2, 19))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: the layers zero the padded positions' inputs
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with rk.substituted(model) as taken:
            got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert MODELS[model_type] <= set(taken), taken
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), float((got - want).abs().max())


def test_entry_points_are_put_back():
    from transformers.models.mamba import modeling_mamba

    model = _tiny("mamba")
    before = dict(vars(modeling_mamba))
    with rk.substituted(model):
        changed = [k for k, v in vars(modeling_mamba).items() if v is not before.get(k)]
        assert changed  # the entry points were replaced
        assert all(rk.kernel_name(before[k]) in rk.WRAPPERS for k in changed)
    assert all(vars(modeling_mamba)[k] is before[k] for k in changed)


def test_linear_attention_reference_matches_the_gated_delta_fallback():
    """The custom op's own recurrence against Hugging Face's token loop, with a past state
    and grouped heads (2 query/key heads serving 4 value heads)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    torch.manual_seed(1)
    b, t, hk, hv, dk, dv = 2, 6, 2, 4, 8, 5
    q, k = torch.randn(b, t, hk, dk), torch.randn(b, t, hk, dk)
    v = torch.randn(b, t, hv, dv)
    g, beta = -torch.rand(b, t, hv), torch.rand(b, t, hv)
    state = torch.randn(b, hv, dk, dv)
    fallback = getattr(hf.torch_recurrent_gated_delta_rule, "__wrapped__", None)
    fallback = fallback or hf.torch_recurrent_gated_delta_rule
    want, want_state = fallback(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    got, got_state = rk.gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    assert torch.allclose(got_state, want_state, atol=1e-5)


def test_packed_sequences_run_as_written():
    with pytest.raises(rk.NotStated, match="cu_seqlens"):
        rk._no_packing({"cu_seqlens": torch.tensor([0, 3])})
    calls = []
    guarded = rk._guarded(
        lambda *a, **k: calls.append("original") or "ran", rk.gated_delta_rule, "x"
    )
    assert guarded(None, None, None, None, None, cu_seqlens=torch.tensor([0, 3])) == "ran"
    assert calls == ["original"]
