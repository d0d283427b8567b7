"""Attention sinks (:mod:`tfgraph.passes.recognize.attention.sink`): a learned logit per head in the
softmax's denominator, written as gpt-oss, Flint and Granite SWA write it, fuses into
``tfgraph.Attention(…, sink)``. ONNX Runtime lowers it to ``GroupQueryAttention`` with
``head_sink`` (cached too); the standard targets decompose it and say why. A per-token sink is
not fused and keeps parity. Hugging Face gpt-oss generates like ``generate``."""

from __future__ import annotations

import idiom_models
import onnx_ir as ir
import pytest

import tfgraph
import tfgraph.exporters.onnx.target as onnx_target
import tfgraph.exporters.tensorrt.target as tensorrt
from tfgraph.runtime import CachedDecoder, Session
from tfgraph.sources import from_module
from tfgraph.verify.generation_parity import compare_greedy

PROMPTS = [[5, 9, 2, 7, 1], [3, 1]]


# slow: three forms of attention sinks fused and cached; concat stays
@pytest.mark.parametrize(
    "style",
    [
        "concat",
        pytest.param("concat_plain", marks=pytest.mark.slow),
        pytest.param("sigmoid", marks=pytest.mark.slow),
    ],
)
def test_sinks_fuse_into_gqa_head_sink_and_cache(style, tmp_path):
    source = from_module(idiom_models.sink_gpt(style), origin=f"idiom:sink_gpt:{style}")
    result = tfgraph.export(source, tmp_path / "art", kv_cache=True)
    report = result.report
    attention = report["fusions"]["attention"]
    assert (attention["fused"], attention["total"]) == (2, 2), attention["missed"]
    assert report["parity"]["prefill"]["passed"] and report["parity"]["decode"]["passed"]
    model = ir.load(tmp_path / "art" / "model.onnx")
    gqa = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2
    assert all(len(n.inputs) == 12 and n.inputs[11] is not None for n in gqa)  # head_sink
    assert [n.attributes.get_int("local_window_size", -1) for n in gqa] == [3, -1]
    assert not [n for n in model.graph if n.op_type == "Softmax"]
    comparison = compare_greedy(source, CachedDecoder(Session(tmp_path / "art")), PROMPTS, 8)
    assert comparison.passed, (comparison.tokens, comparison.want_tokens)


def test_layers_with_equal_sinks_fuse(tmp_path):
    """Layers whose sinks hold the same values (a random checkpoint's ones) share one sink
    initializer once deduplicated, and then one ``Expand`` of it after CSE: matched through
    that Expand, every layer was refused ("Matched nodes have other uses preventing
    replacement") and the KV cache with them. The column is the rule's input, not its match."""
    import torch

    module = idiom_models.sink_gpt("concat")
    with torch.no_grad():
        for block in module.blocks:
            block.attn.sinks.fill_(0.5)
    source = from_module(module, origin="idiom:sink_gpt:equal")
    result = tfgraph.export(source, tmp_path / "art", kv_cache=True)
    attention = result.report["fusions"]["attention"]
    assert (attention["fused"], attention["total"]) == (2, 2), attention["missed"]
    assert result.passed and result.report["parity"]["decode"]["passed"]
    model = ir.load(tmp_path / "art" / "model.onnx")
    gqa = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and gqa[0].inputs[11] is gqa[1].inputs[11]  # one shared head_sink


@pytest.mark.parametrize(
    ("target", "reason"), [("onnx", onnx_target.SINK_MISS), ("tensorrt", tensorrt.SINK_MISS)]
)
def test_standard_targets_decompose_sinks_and_say_why(target, reason, tmp_path):
    source = from_module(idiom_models.sink_gpt("concat"), origin="idiom:sink_gpt")
    result = tfgraph.export(source, tmp_path / "art", target=target, kv_cache=True)
    attention = result.report["fusions"]["attention"]
    assert (attention["fused"], attention["total"]) == (0, 2)
    assert all(reason in m["reason"] for m in attention["missed"]), attention["missed"]
    assert result.passed and result.report["parity"]["decode"]["passed"]
    comparison = compare_greedy(source, CachedDecoder(Session(tmp_path / "art")), PROMPTS, 6)
    assert comparison.passed


def test_a_subtracted_row_max_fuses_without_a_sink(tmp_path):
    source = from_module(idiom_models.sink_gpt("max_shift"), origin="idiom:sink_gpt:max_shift")
    result = tfgraph.export(source, tmp_path / "art", kv_cache=True)
    attention = result.report["fusions"]["attention"]
    assert (attention["fused"], attention["total"]) == (2, 2), attention["missed"]
    assert result.passed and result.report["parity"]["decode"]["passed"]
    model = ir.load(tmp_path / "art" / "model.onnx")
    gqa = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(len(n.inputs) <= 11 for n in gqa)  # no head_sink


def test_a_max_over_another_axis_is_not_dropped():
    """Rejection: ``Softmax(x − max over the queries)`` is not ``Softmax(x)``."""
    from onnxscript.rewriter import RewriteRuleSet

    from tfgraph.passes.recognize.attention.rules import MaxShiftRule
    from tfgraph.passes.rewrite_utils import apply_rules, diagnose

    text = """
    <ir_version: 10, opset_import: ["" : 20]>
    g (float[2, 3, 4, 4] s) => (float[2, 3, 4, 4] p) {
        axes = Constant <value = int64[1] {AXIS}> ()
        m = ReduceMax <keepdims: int = 1> (s, axes)
        d = Sub (s, m)
        p = Softmax <axis: int = -1> (d)
    }
    """
    model = ir.from_onnx_text(text.replace("AXIS", "-2"))
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    assert "not over the last axis" in diagnose(model, [MaxShiftRule.rule()], softmax, depth=0)
    assert apply_rules(model, RewriteRuleSet([MaxShiftRule.rule()])) == 0
    assert (
        apply_rules(
            ir.from_onnx_text(text.replace("AXIS", "-1")), RewriteRuleSet([MaxShiftRule.rule()])
        )
        == 1
    )


def test_a_per_token_sink_is_not_fused_and_keeps_parity(tmp_path):
    """Rejection: a sink projected from each token varies along the queries; GQA's head_sink
    is one value per head. Not fused, the reason names it, and the standard ops are exact."""
    source = from_module(idiom_models.sink_gpt("per_token"), origin="idiom:sink_gpt:per_token")
    result = tfgraph.export(source, tmp_path / "art")
    attention = result.report["fusions"]["attention"]
    assert (attention["fused"], attention["total"]) == (0, 2)
    assert all("per-token sinks" in m["reason"] for m in attention["missed"]), attention
    assert result.passed
    model = ir.load(tmp_path / "art" / "model.onnx")
    assert not [n for n in model.graph if n.domain == "tfgraph"]


# slow: 20 s on GPT-OSS (architecture coverage); the sink rules' own tests stay
@pytest.mark.slow
def test_hf_gpt_oss_generates_like_hf(tmp_path):
    """gpt-oss (MoE, sinks on every layer, sliding window on alternate ones) from a tiny
    config: fused, cached, and 16 greedy tokens equal ``generate`` for a padded batch."""
    transformers = pytest.importorskip("transformers")
    import torch

    from tfgraph.runtime import GenerationConfig, generate
    from tfgraph.runtime.generate import left_pad
    from tfgraph.tools import coverage

    config = coverage.tiny_config("gpt_oss", "causal-lm")
    config.initializer_range = 0.2
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf")
    result = tfgraph.export(str(tmp_path / "hf"), tmp_path / "art", kv_cache=True)
    attention = result.report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == config.num_hidden_layers
    assert result.report["parity"]["prefill"]["passed"]
    assert result.report["parity"]["decode"]["passed"]
    prompts = [[5, 9, 2, 7, 1, 8], [3, 1]]
    got = generate(
        CachedDecoder(Session(tmp_path / "art")),
        prompts,
        GenerationConfig(max_new_tokens=16, pad_token_id=0),
    )
    ids, mask = left_pad(prompts, 0)
    with torch.no_grad():
        want = model.generate(
            torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
        )
    assert got.tokens == want[:, ids.shape[1] :].tolist()


# slow: 36 s; GPT-OSS's sink generation stays in the default tier
@pytest.mark.slow
def test_sinks_with_narrower_value_heads_run_on_multihead_attention(tmp_path):
    """HY-V4: sinks, and V heads narrower than Q/K's (16 vs 32), which GroupQueryAttention
    refuses: MultiHeadAttention takes the sink as one more key (a zero row in K and V, the
    sink logit as its mask column), cached, with DSA's indexer keys cached beside it."""
    transformers = pytest.importorskip("transformers")
    from tfgraph.sources import load_source
    from tfgraph.tools.coverage import tiny_config

    config = tiny_config("hy_v4", "causal-lm")
    transformers.HYV4ForCausalLM(config).eval().save_pretrained(tmp_path / "hf")
    result = tfgraph.export(str(tmp_path / "hf"), tmp_path / "art", kv_cache=True)
    attention = result.report["fusions"]["attention"]
    assert (attention["fused"], attention["total"]) == (2, 2), attention["missed"]
    parity = result.report["parity"]
    assert parity["prefill"]["passed"] and parity["decode"]["passed"], parity["outputs"]
    model = ir.load(tmp_path / "art" / "model.onnx")
    mha = [n for n in model.graph if n.op_type == "MultiHeadAttention"]
    assert len(mha) == 2 and all(n.inputs[5] is not None for n in mha)  # attention_bias
    assert not [n for n in model.graph if n.op_type == "Softmax"]
    source = load_source(str(tmp_path / "hf"))
    comparison = compare_greedy(source, CachedDecoder(Session(tmp_path / "art")), PROMPTS, 8)
    assert comparison.passed, (comparison.tokens, comparison.want_tokens)
