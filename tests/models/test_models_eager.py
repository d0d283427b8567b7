"""Every preset builds, runs eagerly, is deterministic, and implements the input protocol."""

from __future__ import annotations

import functools
import inspect
from dataclasses import replace

import pytest
import torch

from tfgraph.models import PRESETS, ModelConfig, build, describe

TINY = [n for n, c in PRESETS.items() if c.d_model <= 128]
DECODERS = [n for n in TINY if PRESETS[n].family == "decoder"]
WITH_PADDING = [n for n in TINY if PRESETS[n].family != "decoder"]


@functools.cache
def _model(name: str) -> torch.nn.Module:
    return build(name)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _expected_shape(cfg: ModelConfig, batch: int, seq: int) -> tuple[int, ...]:
    if cfg.family == "encoder":
        return (batch, cfg.num_labels)
    return (batch, seq, cfg.vocab_size)


@pytest.mark.parametrize("name", list(PRESETS))
def test_forward_shapes_and_finite(name):
    model = _model(name)
    cfg = model.config
    assert not model.training
    for batch, seq in [(1, 7), (2, 33)]:
        inputs = model.example_inputs(batch, seq, _gen())
        with torch.no_grad():
            out = model(*(inputs[n] for n in model.input_names))
        assert isinstance(out, torch.Tensor)
        assert out.shape == _expected_shape(cfg, batch, seq)
        assert out.dtype == torch.float32
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", list(PRESETS))
def test_input_protocol(name):
    model = _model(name)
    params = list(inspect.signature(model.forward).parameters)
    assert tuple(params) == model.input_names
    assert model.output_names == ("logits",)
    axes = model.dynamic_axes()
    assert set(axes) == set(model.input_names)
    assert all(axes[n][0] == "batch" for n in model.input_names)
    inputs = model.example_inputs(4, 9, _gen())
    assert tuple(inputs) == model.input_names
    ids = inputs["input_ids"]
    assert ids.shape == (4, 9) and ids.dtype == torch.long
    assert 0 <= ids.min() and ids.max() < model.config.vocab_size
    if "attention_mask" in inputs:
        mask = inputs["attention_mask"]
        assert mask.shape == (4, 9)
        assert mask[0].all()  # first row unpadded
        assert (mask == 0).any()  # some padding
        assert mask[:, 0].all()  # right padding: no row is fully masked
        assert torch.all(mask[:, 1:] <= mask[:, :-1])
    if model.config.family == "encoder-decoder":
        assert axes["decoder_input_ids"] == {0: "batch", 1: "decoder_sequence"}
    # the same generator seed gives the same inputs
    again = model.example_inputs(4, 9, _gen())
    assert all(torch.equal(inputs[n], again[n]) for n in inputs)


@pytest.mark.parametrize("name", TINY)
def test_build_is_deterministic_for_a_seed(name):
    a, b, c = build(name, seed=0), build(name, seed=0), build(name, seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    inputs = a.example_inputs(2, 5, _gen())
    with torch.no_grad():
        assert torch.equal(a(*inputs.values()), b(*inputs.values()))


def test_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build("gpt-tiny", seed=7)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", list(PRESETS))
def test_describe_has_the_table_columns(name):
    row = describe(name)
    for key in ("family", "attention", "positions", "norm", "ffn"):
        assert isinstance(row[key], str) and row[key]
    assert row["family"] == PRESETS[name].family


def test_presets_are_tiny_and_long_enough():
    for name in TINY:
        cfg = PRESETS[name]
        assert cfg.n_layers == 2 and cfg.vocab_size <= 256, name
        assert cfg.max_seq_len >= 64, name
    gpt2 = PRESETS["gpt2-small"]
    assert (gpt2.vocab_size, gpt2.d_model, gpt2.n_layers, gpt2.n_heads) == (50257, 768, 12, 12)
    assert gpt2.max_seq_len == 1024
    tiny = PRESETS["gpt-tiny"]
    assert (tiny.d_model, tiny.n_layers, tiny.n_heads, tiny.vocab_size) == (64, 2, 4, 256)
    assert (tiny.positions, tiny.norm_placement, tiny.ffn) == ("learned", "pre", "gelu")


def test_presets_cover_the_seed_features():
    cfgs = PRESETS.values()
    assert {c.family for c in cfgs} == {"decoder", "encoder", "encoder-decoder"}
    assert {c.positions for c in cfgs} >= {"learned", "sinusoidal", "rope", "alibi", "t5", "shaw"}
    assert {c.norm for c in cfgs} == {"layernorm", "layernorm-seed", "rmsnorm"}
    assert {c.ffn for c in cfgs} == {"relu", "gelu", "gelu-tanh", "swiglu", "geglu"}
    assert {c.norm_placement for c in cfgs} == {"pre", "post"}
    assert any(c.kv_heads == 1 for c in cfgs)  # MQA
    assert any((c.n_heads, c.kv_heads) == (64, 8) for c in cfgs)  # Llama-2-70B's ratio
    assert any(c.sliding_window for c in cfgs)
    assert any(c.parallel_block for c in cfgs)
    assert any(c.rope_fraction < 1 for c in cfgs) and any(c.rope_ntk_factor > 1 for c in cfgs)


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_is_causal(name):
    model = _model(name)
    ids = model.example_inputs(1, 12, _gen())["input_ids"]
    changed = ids.clone()
    changed[0, 8] = (ids[0, 8] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])  # the past does not see the future
    assert not torch.allclose(a[:, 8:], b[:, 8:])


@pytest.mark.parametrize("name", WITH_PADDING)
def test_padded_tokens_do_not_change_the_output(name):
    model = _model(name)
    inputs = model.example_inputs(3, 10, _gen())
    pad = inputs["attention_mask"] == 0
    assert pad.any()
    other = dict(inputs)
    other["input_ids"] = torch.where(pad, (inputs["input_ids"] + 7) % 256, inputs["input_ids"])
    changed = dict(inputs)
    changed["input_ids"] = (inputs["input_ids"] + 7) % 256
    with torch.no_grad():
        a, b = model(*inputs.values()), model(*other.values())
        torch.testing.assert_close(a, b)
        assert not torch.allclose(model(*changed.values()), a)  # unpadded tokens do count


@pytest.mark.parametrize("name", [n for n in TINY if PRESETS[n].family == "encoder-decoder"])
def test_encoder_decoder_decoder_is_causal(name):
    model = _model(name)
    inputs = model.example_inputs(1, 10, _gen())
    other = dict(inputs)
    other["decoder_input_ids"] = inputs["decoder_input_ids"].clone()
    other["decoder_input_ids"][0, 6] = (other["decoder_input_ids"][0, 6] + 1) % 256
    with torch.no_grad():
        a, b = model(*inputs.values()), model(*other.values())
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_tied_and_untied_heads():
    assert _model("gpt-tiny").lm_head.weight is _model("gpt-tiny").embed.tok.weight
    assert _model("llama-tiny").lm_head.weight is not _model("llama-tiny").embed.tok.weight
    t5 = _model("t5-tiny")
    assert t5.encoder_embed.tok is t5.decoder_embed.tok is t5.shared


def test_unknown_preset_and_bad_configs():
    with pytest.raises(KeyError, match="unknown preset"):
        build("no-such-model")
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(n_heads=8, n_kv_heads=3, d_model=64)
    with pytest.raises(ValueError, match="positions"):
        ModelConfig(positions="xpos")
    with pytest.raises(ValueError, match="pre-LN"):
        replace(PRESETS["palm-tiny"], norm_placement="post")


# --- the idioms a config can write (issue 14): same function, other graph -----------------
_BASE = {"d_model": 32, "n_heads": 4, "n_layers": 2, "vocab_size": 64, "max_seq_len": 64}
_SAME_FUNCTION = [
    ({"attn_impl": "sdpa", "positions": "rope", "mask_style": "is-causal"}, "mask_style"),
    ({"positions": "alibi", "mask_style": "select-fill"}, "mask_style"),
    ({"sliding_window": 3, "mask_style": "select-where"}, "mask_style"),
    ({"norm": "rmsnorm", "norm_order": "w*x*r"}, "norm_order"),
    ({"norm_order": "x/s*w"}, "norm_order"),
    ({"family": "encoder-decoder", "attn_impl": "sdpa", "mask_style": "is-causal"}, "mask_style"),
]


@pytest.mark.parametrize(("fields", "form"), _SAME_FUNCTION)
def test_idioms_compute_the_default_function(fields, form):
    written = ModelConfig(**_BASE, **fields)
    default = replace(written, **{form: ModelConfig.__dataclass_fields__[form].default})
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    outs = []
    for cfg in (written, default):
        model = build(cfg, seed=0).eval()
        inputs = model.example_inputs(2, 9, torch.Generator().manual_seed(1))
        inputs[model.input_names[0]] = ids
        with torch.no_grad():
            outs.append(model(*(inputs[n] for n in model.input_names)))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-5)


def test_softcap_bounds_the_scores():
    """The softmax sees cap·tanh(scores/cap) (finite entries within ±cap), then the mask."""
    cfg = ModelConfig(**_BASE, softcap=0.5)
    model = build(cfg).eval()
    seen = []
    model.decoder.blocks[0].attn.softmax.register_forward_hook(
        lambda module, args, out: seen.append(args[0])
    )
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        capped = model(ids)
        uncapped = build(replace(cfg, softcap=None)).eval()(ids)
    finite = seen[0][torch.isfinite(seen[0])]
    assert finite.abs().max() <= 0.5 and torch.isinf(seen[0]).any()  # capped, then masked
    assert not torch.allclose(capped, uncapped)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"mask_style": "select-fill", "attn_impl": "sdpa"}, "explicit attention"),
        ({"mask_style": "is-causal"}, "is_causal"),
        ({"mask_style": "is-causal", "attn_impl": "sdpa", "positions": "alibi"}, "is_causal"),
        ({"softcap": 5.0, "attn_impl": "sdpa"}, "softcap"),
        ({"norm_order": "w*x*r", "norm": "layernorm-seed"}, "norm_order"),
        ({"norm_order": "x*y"}, "norm_order"),
    ],
)
def test_idiom_fields_are_validated(fields, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig(**_BASE, **fields)
