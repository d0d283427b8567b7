"""RWKV (v4): the ``wkv`` recurrence, a Python loop over the tokens in Hugging Face, traced as one
``tfgraph.LinearAttention`` per layer (gated, one head per channel, d_k = 1, d_v = 2: the
numerator and the denominator), the token shifts as width-2 ``tfgraph.CausalConv`` s; cached,
at parity with eager, and generating what eager greedy decoding generates
(tfgraph/sources/rwkv.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from transformers.models.rwkv import modeling_rwkv  # noqa: E402

import tfgraph  # noqa: E402
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, generate  # noqa: E402
from tfgraph.runtime.generate import left_pad  # noqa: E402
from tfgraph.sources import rwkv  # noqa: E402
from tfgraph.sources.huggingface import hf_source  # noqa: E402
from tfgraph.tools.coverage import config_for, tiny_config  # noqa: E402
from tfgraph.tools.coverage_generation import NEW_TOKENS, PROMPTS, _eager_greedy_causal  # noqa: E402

# fp32 throughout: the op's own recurrence and Hugging Face's loop agree to rounding
ATOL, RTOL = 1e-5, 1e-4
LAYERS = 2
RECURRENT_OPS = LAYERS * 4  # per layer: the wkv, its (a, b) shift, two token shifts


def _model(rescale_every: int | None = None):
    cls = transformers.RwkvForCausalLM
    config = config_for(cls, tiny_config("rwkv", "causal-lm"))
    if rescale_every is not None:
        config.rescale_every = rescale_every
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = _model()
    work = tmp_path_factory.mktemp("rwkv")
    model.save_pretrained(work / "hf")
    return work, model


@pytest.mark.parametrize("decay_scale", [1.0, 3.0])
def test_wkv_is_the_token_loop(decay_scale):
    torch.manual_seed(1)
    batch, length, channels = 2, 37, 8
    time_decay = torch.randn(channels) * decay_scale  # w = −e^{td}: from −0.05 to −e^9
    time_first = torch.randn(channels)
    key, value = torch.randn(batch, length, channels) * 3, torch.randn(batch, length, channels)
    want, (num, den, peak) = modeling_rwkv.rwkv_linear_attention_cpu(
        time_decay, time_first, key, value, return_state=True
    )
    got, state = rwkv.wkv(time_decay, time_first, key, value)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # the state is Hugging Face's, unnormalized: (num·e^max, den·e^max)
    torch.testing.assert_close(state[:, :, 0, 0], num * peak.exp(), atol=1e-4, rtol=RTOL)
    torch.testing.assert_close(state[:, :, 0, 1], den * peak.exp(), atol=1e-4, rtol=RTOL)


def test_substituted_model_is_eager(tiny):
    _, model = tiny
    ids = torch.randint(3, 500, (2, 33))
    original = modeling_rwkv.rwkv_linear_attention
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        with rwkv.substituted(model) as shifts:
            assert modeling_rwkv.rwkv_linear_attention is not original
            got = model(input_ids=ids, use_cache=False).logits
    assert shifts == 2 * LAYERS  # time and channel mixing of each layer
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert modeling_rwkv.rwkv_linear_attention is original  # restored
    assert not any("forward" in vars(m) for m in model.modules())


def _greedy(work, prompts):
    decoder = CachedDecoder(Session(work))
    return generate(decoder, prompts, GenerationConfig(max_new_tokens=NEW_TOKENS)).tokens


def test_rwkv_is_cached_and_generates(tiny):
    work, model = tiny
    result = tfgraph.export(str(work / "hf"), work / "cached", kv_cache=True, target="ort")
    recurrent = result.report["fusions"]["recurrent"]
    assert recurrent["fused"] == recurrent["total"] == RECURRENT_OPS
    parity = result.report["parity"]
    assert parity["passed"] and parity["decode"]["passed"], parity["outputs"]
    assert parity["prefill"]["max_abs_err"] < 1e-4 and parity["decode"]["max_abs_err"] < 1e-4

    # left-padded batch: RWKV ignores the mask, so the pads are tokens, in eager as here
    prompts = [list(p) for p in PROMPTS]
    ids, mask = (torch.from_numpy(a) for a in left_pad(prompts, 0))
    assert _greedy(work / "cached", prompts) == _eager_greedy_causal(model, ids, mask)
    # one prompt at a time Hugging Face's own cached decoding agrees too (with a batch of
    # more than one its one-token step broadcasts the shifted state across the batch)
    for prompt in prompts:
        with torch.no_grad():
            want = model.generate(
                input_ids=torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )[0, len(prompt) :].tolist()
        assert _greedy(work / "cached", [prompt]) == [want]


def test_rescaled_layers_are_the_eager_model(tmp_path):
    """rescale_every = 1: eager Hugging Face divides block i's output projections by 2^i in
    place on its first forward and halves the hidden state after each block; the graph states
    the division, so it computes what eager does, from the unscaled weights."""
    model = _model(rescale_every=1)
    source = hf_source(model, origin="rwkv-rescaled")
    result = tfgraph.export(source, tmp_path / "cached", kv_cache=True, target="ort")
    parity = result.report["parity"]
    assert parity["passed"] and parity["decode"]["passed"], parity["outputs"]
    assert model.rwkv.layers_are_rescaled  # eager ran rescaled


def test_rescaled_checkpoint_traces_the_division(tmp_path):
    """From a checkpoint the trace has no weights to divide (they are bound from the file
    afterwards): the graph divides the projections' outputs instead, and runs as the eager
    model loaded whole does. (The streamed eager reference of the parity check cannot rescale
    weights it reads from disk, so its own parity is not asserted here.)"""
    import numpy as np
    from ort_run import ort_session

    model = _model(rescale_every=1)
    model.save_pretrained(tmp_path / "hf")
    tfgraph.export(str(tmp_path / "hf"), tmp_path / "cached", kv_cache=True, target="ort")
    session = ort_session(tmp_path / "cached" / "model.onnx")
    ids = np.random.default_rng(0).integers(3, 500, (2, 9))
    feeds = {}
    for port in session.get_inputs():
        if port.name == "input_ids":
            feeds[port.name] = ids
        elif port.name == "attention_mask":
            feeds[port.name] = np.ones_like(ids)
        else:  # a past state: zeros before the first token
            dims = [2 if d == "batch" else d for d in port.shape]
            feeds[port.name] = np.zeros(dims, np.float32)
    got = session.run(["logits"], feeds)[0]
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()
    assert model.rwkv.layers_are_rescaled
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)
