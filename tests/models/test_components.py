"""Zoo components against independent computations: masks, positions, norms, GQA, SDPA."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tfgraph.models import PRESETS, ModelConfig, build
from tfgraph.models.attention import Attention, causal_mask, padding_mask
from tfgraph.models.ffn import make_ffn
from tfgraph.models.norms import LayerNorm, RMSNorm, SeedLayerNorm, make_norm
from tfgraph.models.positions import (
    ALiBi,
    RotaryEmbedding,
    ShawRelativeKeys,
    alibi_slopes,
    apply_rope,
    sinusoidal,
    t5_relative_bucket,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _capture_weights(model: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """Run hooks on every attention softmax under ``prefix``; returns name → weights A."""
    captured: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if name.startswith(prefix) and name.endswith(".softmax"):
            module.register_forward_hook(
                lambda _m, _i, out, name=name: captured.__setitem__(name, out.detach())
            )
    return captured


# --- attention masks ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "palm-tiny", "bloom-tiny", "t5-tiny"])
def test_causal_attention_weights_are_lower_triangular(name):
    model = build(name)
    weights = _capture_weights(model, "decoder.blocks")
    inputs = model.example_inputs(2, 12, _gen())
    with torch.no_grad():
        model(*inputs.values())
    self_attn = {n: w for n, w in weights.items() if ".attn." in n}
    assert len(self_attn) == model.config.n_layers
    T = 12
    above = torch.ones(T, T, dtype=torch.bool).triu(1)
    for w in self_attn.values():
        assert w.shape[-2:] == (T, T)
        assert torch.all(w[..., above] == 0)  # −∞ above the diagonal → exactly 0
        assert torch.all(w[..., ~above] > 0)  # and nothing else is masked
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))


def test_sliding_window_masks_old_keys_too():
    model = build("mistral-tiny")
    window = model.config.sliding_window
    weights = _capture_weights(model, "decoder.blocks")
    T = 3 * window
    with torch.no_grad():
        model(*model.example_inputs(1, T, _gen()).values())
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = (j <= i) & (i - j < window)
    for w in weights.values():
        assert torch.all(w[..., ~visible] == 0)
        assert torch.all(w[..., visible] > 0)


def test_encoder_attention_is_bidirectional_and_skips_padding():
    model = build("bert-tiny")
    weights = _capture_weights(model, "encoder.blocks")
    inputs = model.example_inputs(3, 10, _gen())
    keep = inputs["attention_mask"].bool()
    assert not keep.all()
    with torch.no_grad():
        model(*inputs.values())
    for w in weights.values():  # (B, nh, T, S)
        pad = ~keep[:, None, None, :].expand_as(w)
        assert torch.all(w[pad] == 0)
        assert torch.all(w[~pad] > 0)  # keys above the diagonal are seen


def test_masks_are_built_from_shapes():
    m = causal_mask(5, torch.device("cpu"))
    assert torch.equal(m, torch.full((5, 5), float("-inf")).triu(1))
    w = causal_mask(6, torch.device("cpu"), window=2)
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    assert torch.equal(w == 0, (j <= i) & (i - j < 2))
    pad = padding_mask(torch.tensor([[1, 1, 0], [1, 1, 1]]))
    assert pad.shape == (2, 1, 1, 3)
    assert pad[0, 0, 0].tolist() == [0.0, 0.0, float("-inf")]
    assert torch.all(pad[1] == 0)


# --- positions ------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [16, 5])  # odd d (found by the fuzzer): the last column is a sin
def test_sinusoidal_matches_the_formula(d):
    n = 50
    pe = sinusoidal(torch.arange(n), d)
    expected = torch.empty(n, d, dtype=torch.float64)
    for pos in range(n):
        for k in range(d):
            two_i = k - k % 2
            angle = pos / 10000 ** (two_i / d)
            expected[pos, k] = math.sin(angle) if k % 2 == 0 else math.cos(angle)
    torch.testing.assert_close(pe.double(), expected, atol=1e-5, rtol=0)


def test_sinusoidal_positions_are_added_to_scaled_embeddings():
    model = build("transformer-tiny")
    ids = torch.randint(0, 256, (2, 7), generator=_gen())
    d = model.config.d_model
    expected = model.shared(ids) * math.sqrt(d) + sinusoidal(torch.arange(7), d)
    torch.testing.assert_close(model.encoder_embed(ids), expected)


def _rope_score(rope: RotaryEmbedding, q, k, m: int, n: int) -> torch.Tensor:
    cos, sin = rope(torch.arange(max(m, n) + 1))
    qm = apply_rope(q, cos[m : m + 1], sin[m : m + 1])
    kn = apply_rope(k, cos[n : n + 1], sin[n : n + 1])
    return (qm * kn).sum(-1)


@pytest.mark.parametrize("name", ["llama-tiny", "llama-ntk-tiny", "phi-tiny", "llama2-70b-tiny"])
def test_rope_score_depends_only_on_relative_offset(name):
    cfg = PRESETS[name]
    rope = RotaryEmbedding(cfg)
    q = torch.randn(1, 1, 1, cfg.head_dim, generator=_gen(1))
    k = torch.randn(1, 1, 1, cfg.head_dim, generator=_gen(2))
    for m, n in [(3, 1), (10, 0), (5, 9)]:
        base = _rope_score(rope, q, k, m, n)
        for shift in (1, 7, 40):
            torch.testing.assert_close(_rope_score(rope, q, k, m + shift, n + shift), base)
    # and it does depend on the offset
    assert not torch.allclose(_rope_score(rope, q, k, 3, 1), _rope_score(rope, q, k, 3, 2))


@pytest.mark.parametrize("name", ["llama-tiny", "llama-ntk-tiny", "phi-tiny"])
def test_rope_matches_complex_rotation(name):
    """Each pair (x_i, x_{i+d/2}) of the rotary width d is x·e^{i·pos·θ_i} as a complex number."""
    cfg = PRESETS[name]
    d, hs = cfg.rotary_dim, cfg.head_dim
    x = torch.randn(1, 1, 6, hs, generator=_gen(), dtype=torch.float64)
    theta = cfg.rope_base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    angle = torch.arange(6, dtype=torch.float64)[:, None] * theta  # (T, d/2)
    z = torch.complex(x[..., : d // 2], x[..., d // 2 : d]) * torch.polar(
        torch.ones_like(angle), angle
    )
    expected = torch.cat([z.real, z.imag, x[..., d:]], dim=-1)
    cos, sin = RotaryEmbedding(cfg)(torch.arange(6))
    torch.testing.assert_close(
        apply_rope(x.float(), cos, sin).double(), expected, atol=1e-5, rtol=0
    )
    if cfg.rope_ntk_factor != 1.0:
        alpha = cfg.rope_ntk_factor
        assert cfg.rope_base == pytest.approx(cfg.rope_theta * alpha ** (d / (d - 2)))
    if cfg.rope_fraction < 1.0:
        assert d < hs


def test_alibi_slopes_power_of_two():
    for n in (1, 2, 4, 8, 16):
        expected = [2 ** (-8 * (h + 1) / n) for h in range(n)]  # 2^(−8/n), its powers
        torch.testing.assert_close(alibi_slopes(n), torch.tensor(expected), rtol=1e-6, atol=0)
    assert alibi_slopes(8).tolist() == [2.0**-k for k in range(1, 9)]


def test_alibi_slopes_non_power_of_two():
    # the 4 slopes of 4 heads, then every other slope of 8 heads: 2^-1, 2^-3
    assert alibi_slopes(6).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    # 12 heads: the 8-head series, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 from the 16-head one
    expected = [2.0**-k for k in range(1, 9)] + [2 ** -(k + 0.5) for k in range(4)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected), rtol=1e-6, atol=0)


def test_alibi_bias_is_linear_in_distance():
    cfg = ModelConfig(positions="alibi", n_heads=4)
    m = alibi_slopes(4)[:, None, None]
    i, j = torch.arange(5)[:, None].float(), torch.arange(7)[None, :].float()
    causal = ALiBi(cfg, causal=True)(5, 7, torch.device("cpu"))
    bidirectional = ALiBi(cfg, causal=False)(5, 7, torch.device("cpu"))
    torch.testing.assert_close(causal[0], -m * (i - j))
    torch.testing.assert_close(bidirectional[0], -m * (i - j).abs())


def _t5_bucket_reference(rel: int, bidirectional: bool, num_buckets: int, max_distance: int):
    """The T5 formula for one offset rel = j − i, in plain Python."""
    ret, n = 0, -rel
    if bidirectional:
        num_buckets //= 2
        if n < 0:
            ret, n = num_buckets, -n
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    ratio = math.log(n / max_exact) / math.log(max_distance / max_exact)
    return ret + min(max_exact + int(ratio * (num_buckets - max_exact)), num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 40)])
def test_t5_buckets_match_reference(bidirectional, num_buckets, max_distance):
    rel = torch.arange(-300, 300)
    got = t5_relative_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    expected = [_t5_bucket_reference(r, bidirectional, num_buckets, max_distance) for r in rel]
    assert got.tolist() == expected
    assert got.min() >= 0 and got.max() == num_buckets - 1


def test_t5_bias_is_shared_by_layers_and_per_stack():
    model = build("t5-tiny")
    enc, dec = model.encoder.position_bias, model.decoder.position_bias
    assert enc.bidirectional and not dec.bidirectional
    bias = enc(4, 4, torch.device("cpu"))  # (1, nh, T, S)
    i, j = torch.arange(4)[:, None], torch.arange(4)[None, :]
    buckets = t5_relative_bucket(j - i, bidirectional=True, num_buckets=32, max_distance=128)
    torch.testing.assert_close(bias[0], enc.bias.weight[buckets].permute(2, 0, 1))


def test_shaw_relative_term_matches_double_loop():
    cfg = PRESETS["shaw-tiny"]
    torch.manual_seed(0)
    rel = ShawRelativeKeys(cfg)
    k, T, nh, hs = cfg.shaw_max_distance, 2 * cfg.shaw_max_distance + 5, cfg.n_heads, cfg.head_dim
    q = torch.randn(2, nh, T, hs, generator=_gen())
    got = rel(q, T)
    table = rel.w_kr(rel.r.weight).view(2 * k + 1, nh, hs)  # r_d W_K^R for d = −k … k
    expected = torch.empty(2, nh, T, T)
    for i in range(T):
        for j in range(T):
            d = max(-k, min(k, i - j))
            expected[:, :, i, j] = (q[:, :, i] * table[d + k]).sum(-1)
    torch.testing.assert_close(got, expected)


# --- norms ----------------------------------------------------------------------------------


def _random_affine(norm: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        norm.weight.copy_(torch.randn(norm.weight.shape, generator=_gen(3)))
        if getattr(norm, "bias", None) is not None:
            norm.bias.copy_(torch.randn(norm.bias.shape, generator=_gen(4)))
    return norm


def test_layernorm_matches_functional():
    x = 3 * torch.randn(2, 5, 32, generator=_gen()) + 1
    ln = _random_affine(LayerNorm(32, eps=1e-5))
    expected = F.layer_norm(x, (32,), ln.weight, ln.bias, 1e-5)
    torch.testing.assert_close(ln(x), expected)
    no_bias = _random_affine(LayerNorm(32, eps=1e-5, bias=False))
    torch.testing.assert_close(no_bias(x), F.layer_norm(x, (32,), no_bias.weight, None, 1e-5))


def test_rmsnorm_matches_functional_and_upcasts():
    x = 3 * torch.randn(2, 5, 32, generator=_gen()) + 1
    rms = _random_affine(RMSNorm(32, eps=1e-6))
    torch.testing.assert_close(rms(x), F.rms_norm(x, (32,), rms.weight, 1e-6))
    # reduced precision: computed in fp32, rounded once at the end
    xh = x.to(torch.bfloat16)
    out = rms.to(torch.bfloat16)(xh)
    assert out.dtype == torch.bfloat16
    ref = F.rms_norm(xh.float(), (32,), None, 1e-6).to(torch.bfloat16) * rms.weight
    torch.testing.assert_close(out, ref)


def test_seed_layernorm_matches_its_formula_not_layer_norm():
    x = 0.05 * torch.randn(2, 5, 32, generator=_gen())  # small σ: where ε placement matters
    eps = 1e-2
    seed = _random_affine(SeedLayerNorm(32, eps=eps))
    mu = x.mean(-1, keepdim=True)
    sigma = x.std(-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(seed(x), seed.weight * (x - mu) / (sigma + eps) + seed.bias)
    assert not torch.allclose(seed(x), F.layer_norm(x, (32,), seed.weight, seed.bias, eps))


def test_make_norm_follows_config():
    assert isinstance(make_norm(PRESETS["llama-tiny"]), RMSNorm)
    assert isinstance(make_norm(PRESETS["seed-layernorm-tiny"]), SeedLayerNorm)
    ln = make_norm(PRESETS["mpt-tiny"])
    assert type(ln) is LayerNorm and ln.bias is None


# --- feed-forward ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ffn", "act"),
    [
        ("relu", F.relu),
        ("gelu", F.gelu),
        ("gelu-tanh", lambda x: F.gelu(x, approximate="tanh")),
    ],
)
def test_plain_ffn(ffn, act):
    f = make_ffn(ModelConfig(ffn=ffn, d_model=32))
    assert f.w1.out_features == 4 * 32  # d_ff = 4·d_model
    x = torch.randn(2, 3, 32, generator=_gen())
    torch.testing.assert_close(
        f(x), F.linear(act(F.linear(x, f.w1.weight, f.w1.bias)), f.w2.weight, f.w2.bias)
    )


@pytest.mark.parametrize(
    ("ffn", "act"), [("swiglu", F.silu), ("geglu", lambda x: F.gelu(x, approximate="tanh"))]
)
def test_gated_ffn(ffn, act):
    f = make_ffn(ModelConfig(ffn=ffn, d_model=32, d_ff=48, bias=False))
    x = torch.randn(2, 3, 32, generator=_gen())
    expected = (act(x @ f.w1.weight.T) * (x @ f.w3.weight.T)) @ f.w2.weight.T
    torch.testing.assert_close(f(x), expected)


# --- MHA / MQA / GQA ------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_gqa_equals_mha_with_repeated_kv_weights(kv_heads):
    gqa_cfg = ModelConfig(d_model=64, n_heads=8, n_kv_heads=kv_heads)
    mha_cfg = ModelConfig(d_model=64, n_heads=8, n_kv_heads=8)
    torch.manual_seed(0)
    gqa, mha = Attention(gqa_cfg), Attention(mha_cfg)
    group, hs = 8 // kv_heads, gqa_cfg.head_dim
    state = dict(gqa.state_dict())
    for proj in ("k_proj", "v_proj"):  # head h of MHA uses KV head h // group
        w = state[f"{proj}.weight"].view(kv_heads, hs, 64)  # (nkv, hs, C)
        b = state[f"{proj}.bias"].view(kv_heads, hs)  # (nkv, hs)
        state[f"{proj}.weight"] = w.repeat_interleave(group, 0).reshape(8 * hs, 64)
        state[f"{proj}.bias"] = b.repeat_interleave(group, 0).reshape(8 * hs)
    mha.load_state_dict(state)
    x = torch.randn(2, 9, 64, generator=_gen())
    mask = causal_mask(9, x.device)
    torch.testing.assert_close(gqa(x, mask), mha(x, mask))
    # and against PyTorch's own grouped SDPA
    q = gqa.q_proj(x).view(2, 9, 8, hs).transpose(1, 2)
    k = gqa.k_proj(x).view(2, 9, kv_heads, hs).transpose(1, 2)
    v = gqa.v_proj(x).view(2, 9, kv_heads, hs).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(gqa(x, mask), gqa.o_proj(y.transpose(1, 2).reshape(2, 9, 64)))


def test_kv_heads_equal_to_query_heads_is_mha():
    torch.manual_seed(0)
    explicit = Attention(ModelConfig(d_model=32, n_heads=4, n_kv_heads=4))
    default = Attention(ModelConfig(d_model=32, n_heads=4))
    default.load_state_dict(explicit.state_dict())
    x = torch.randn(1, 5, 32, generator=_gen())
    torch.testing.assert_close(explicit(x), default(x))


def test_cross_attention_reads_keys_and_values_from_context():
    torch.manual_seed(0)
    attn = Attention(ModelConfig(d_model=32, n_heads=4), cross=True)
    x, memory = torch.randn(2, 3, 32, generator=_gen(1)), torch.randn(2, 6, 32, generator=_gen(2))
    q = attn.q_proj(x).view(2, 3, 4, 8).transpose(1, 2)
    k = attn.k_proj(memory).view(2, 6, 4, 8).transpose(1, 2)
    v = attn.v_proj(memory).view(2, 6, 4, 8).transpose(1, 2)
    y = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), -1) @ v  # (B, nh, T, hs)
    expected = attn.o_proj(y.transpose(1, 2).reshape(2, 3, 32))
    torch.testing.assert_close(attn(x, context=memory), expected)


# --- the SDPA switch ------------------------------------------------------------------------

SDPA_ALLOWED = [n for n, c in PRESETS.items() if c.positions != "shaw" and c.d_model <= 128]


@pytest.mark.parametrize("name", SDPA_ALLOWED)
def test_sdpa_switch_equals_explicit(name):
    cfg = PRESETS[name]
    explicit = build(replace(cfg, attn_impl="explicit"))
    sdpa = build(replace(cfg, attn_impl="sdpa"))
    inputs = explicit.example_inputs(3, 17, _gen())
    with torch.no_grad():
        torch.testing.assert_close(
            sdpa(*inputs.values()), explicit(*inputs.values()), atol=1e-4, rtol=1e-4
        )


def test_sdpa_presets_are_sdpa_twins():
    twins = [n for n in PRESETS if n.endswith("-sdpa")]
    assert len(twins) >= 4
    for name in twins:
        base = name.removesuffix("-sdpa")
        assert PRESETS[name] == replace(PRESETS[base], attn_impl="sdpa")


def test_shaw_relative_keys_reject_sdpa():
    with pytest.raises(ValueError, match="SDPA"):
        replace(PRESETS["shaw-tiny"], attn_impl="sdpa")
