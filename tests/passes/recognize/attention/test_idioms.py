"""Attention written the common ways (issue: "any model, really"): SDPA with ``is_causal``
(nanoGPT, with and without ``enable_gqa``), ``nn.MultiheadAttention(is_causal=True)``,
``nn.Transformer(tgt_is_causal=True)``. Each fuses completely, is recognized as causal, and is
KV-cached: prefill and decode parity, and greedy generation equal to eager recompute."""

from __future__ import annotations

import idiom_models
import onnx_ir as ir
import pytest

import tfgraph
from tfgraph.exporters.tensorrt.target import SOFTCAP_MISS
from tfgraph.passes.recognize.attention.classify_bias import ClassifyAttentionBiasPass, Subgraphs
from tfgraph.runtime import CachedDecoder, Session
from tfgraph.sources import from_module
from tfgraph.verify.generation_parity import compare_greedy, encoder_inputs

PROMPTS = [[5, 9, 2, 7, 1], [3, 1]]
CASES = [
    ("gpt", "ort"),
    ("gpt", "onnx"),  # opset 23: SDPA exported as ONNX Attention(is_causal=1), top-left
    ("gpt_gqa", "ort"),
    ("gpt_gqa", "onnx"),
    ("mha_lm", "ort"),
    ("seq2seq", "ort"),
    # slow: 10 s; seq2seq on ort stays, and gpt on onnx keeps ONNX Attention's is_causal
    pytest.param("seq2seq", "onnx", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("factory", "target"), CASES)
def test_is_causal_models_fuse_and_cache(factory, target, tmp_path):
    source = from_module(getattr(idiom_models, factory)(), origin=f"idiom:{factory}")
    result = tfgraph.export(source, tmp_path / "art", target=target, kv_cache=True)
    report = result.report
    assert report["parity"]["passed"], report["parity"]["outputs"]
    assert report["parity"]["prefill"]["passed"] and report["parity"]["decode"]["passed"]
    attention = report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] >= 2, attention["missed"]
    decoder = CachedDecoder(Session(tmp_path / "art"))
    prompts, extra = PROMPTS, {}
    if decoder.seq2seq:
        prompts, extra = [[0]] * len(PROMPTS), encoder_inputs(decoder, PROMPTS)
    comparison = compare_greedy(source, decoder, prompts, 8, extra=extra)
    assert comparison.passed, (comparison.tokens, comparison.want_tokens)


def test_sdpa_is_causal_is_classified_causal_without_a_bias(tmp_path):
    """The opset-20 decomposition builds the mask from Shape(Q) and Shape(K): evaluated with
    stand-ins of those shapes, it is a plain causal mask, dropped into the kernel's causal."""
    source = from_module(idiom_models.gpt(), origin="idiom:gpt")
    result = tfgraph.export(source, tmp_path / "art")
    model = ir.load(tmp_path / "art" / "model.onnx")
    gqa = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(n.attributes["causal"].value == 1 for n in gqa)
    assert all(len(n.inputs) <= 7 for n in gqa)  # no attention_bias input: the mask is gone
    assert result.passed


def _graph_with_fused_producer(mask_reads_values: bool) -> ir.Model:
    """x → tfgraph op → h; a causal mask built from Shape(h) (and, optionally, h's values)
    feeds a canonical attention's bias slot."""
    text = """
    <ir_version: 10, opset_import: ["" : 20, "tfgraph" : 1]>
    g (float[batch, sequence, 8] x) => (float[batch, 2, sequence, 4] y)
    <float[batch, sequence, 8] h> {
        h = tfgraph.LayerNorm <epsilon: float = 1e-5> (x)
        shape = Shape <start: int = 1, end: int = 2> (h)
        square = Concat <axis: int = 0> (shape, shape)
        one = Constant <value = float {1.0}> ()
        ones = Expand (one, square)
        low = Trilu <upper: int = 0> (ones)
        zero = Constant <value = float {0.0}> ()
        keep = Equal (low, zero)
        lowest = Constant <value = float {-3.4e38}> ()
        mask = Where (keep, lowest, zero)
        axes = Constant <value = int64[2] {0, 1}> ()
        mask4 = Unsqueeze (mask, axes)
        r = Constant <value = int64[4] {0, 0, 2, 4}> ()
        t = Reshape (h, r)
        q = Transpose <perm: ints = [0, 2, 1, 3]> (t)
        bias = Add (mask4, EXTRA)
        y = tfgraph.Attention <num_heads: int = 2, kv_num_heads: int = 2, scale: float = 0.5,
            causal: int = 0, causal_alignment: string = "bottom_right", window: int = 0,
            bias_kind: string = "additive", cached: int = 0> (q, q, q, bias)
    }
    """
    extra = "ReduceMean <keepdims: int = 0> (h)" if mask_reads_values else "Identity (zero)"
    text = text.replace(
        "bias = Add (mask4, EXTRA)", f"extra = {extra}\n        bias = Add (mask4, extra)"
    )
    model = ir.from_onnx_text(text)
    return model


def test_a_mask_from_a_fused_ops_shape_is_evaluated():
    model = _graph_with_fused_producer(mask_reads_values=False)
    node = next(n for n in model.graph if n.op_type == "Attention")
    assert Subgraphs(model).get(node.inputs[3]) is not None
    assert ClassifyAttentionBiasPass()(model).modified
    assert node.attributes["causal"].value == 1 and len(node.inputs) == 3  # bias dropped


def test_a_bias_reading_a_fused_ops_values_is_not_evaluated():
    """Rejection: a stand-in feeds only shapes, so a bias that also reads the fused op's values
    is not evaluated as a whole; its causal mask is split off and the rest kept as the bias."""
    model = _graph_with_fused_producer(mask_reads_values=True)
    node = next(n for n in model.graph if n.op_type == "Attention")
    extra = node.inputs[3].producer().inputs[1]
    assert Subgraphs(model).get(node.inputs[3]) is None
    assert ClassifyAttentionBiasPass()(model).modified
    assert node.attributes["causal"].value == 1
    assert node.inputs[3] is extra and node.attributes["bias_kind"].value == "additive"
    assert node.metadata_props["tfgraph.bias_classified"] == "additive (causal mask split off)"


@pytest.mark.parametrize("topk_first", [False, True])
def test_router_softmax_is_not_an_attention_candidate(topk_first, tmp_path):
    """A mixture-of-experts router's softmax over experts (or, as Aria writes it, over the
    top-k experts' logits) is a gate: the report counts the 2 attention layers only (2/2, not
    2/4), and the decoder is KV-cached."""
    source = from_module(idiom_models.moe_gpt(topk_first), origin="idiom:moe_gpt")
    result = tfgraph.export(source, tmp_path / "art", kv_cache=True)
    attention = result.report["fusions"]["attention"]
    assert (attention["fused"], attention["total"], attention["missed"]) == (2, 2, [])
    assert result.passed and result.report["parity"]["decode"]["passed"]
    model = ir.load(tmp_path / "art" / "model.onnx")
    assert sum(n.op_type == "Softmax" for n in model.graph) == 2  # the routers stay
    decoder = CachedDecoder(Session(tmp_path / "art"))
    assert compare_greedy(source, decoder, PROMPTS, 6).passed


def test_a_softmax_over_keys_is_still_a_candidate():
    """Rejection: a softmax over a dynamic axis (keys) is never taken for a gate, even when it
    reads a projection by a constant weight."""
    from tfgraph.passes.recognize.attention.fuse import is_gating_softmax

    model = ir.from_onnx_text("""
    <ir_version: 10, opset_import: ["" : 20]>
    g (float[2, sequence, 8] x) => (float[2, sequence, 4] gate, float[2, 8, sequence] keys) {
        w = Constant <value = float[8, 4] {1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
            1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
            1.0, 1.0, 1.0, 1.0}> ()
        logits = MatMul (x, w)
        gate = Softmax <axis: int = -1> (logits)
        xt = Transpose <perm: ints = [0, 2, 1]> (x)
        keys = Softmax <axis: int = -1> (xt)
    }
    """)
    ir.passes.common.ShapeInferencePass()(model)
    gate, keys = (n for n in model.graph if n.op_type == "Softmax")
    assert is_gating_softmax(gate)
    assert not is_gating_softmax(keys)


@pytest.mark.parametrize(
    "style", ["masked_fill", "where_min", "bias_and_select", "select_then_bias"]
)
def test_selection_masks_fuse_and_cache(style, tmp_path):
    """``masked_fill(mask == 0, -inf)`` / ``where(keep, scores, min)`` before the softmax (also
    on top of an additive bias, or under one added after the selection) fuse, are classified
    causal, and KV-cache."""
    source = from_module(idiom_models.select_gpt(style), origin=f"idiom:select_gpt:{style}")
    result = tfgraph.export(source, tmp_path / "art", kv_cache=True)
    attention = result.report["fusions"]["attention"]
    assert (attention["fused"], attention["total"]) == (2, 2), attention["missed"]
    assert result.passed and result.report["parity"]["decode"]["passed"]
    model = ir.load(tmp_path / "art" / "model.onnx")
    gqa = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(n.attributes["causal"].value == 1 for n in gqa)
    decoder = CachedDecoder(Session(tmp_path / "art"))
    assert compare_greedy(source, decoder, PROMPTS, 6).passed


def test_an_additive_minus_10000_is_not_a_selection():
    """Rejection: ``Where(keep, s, -10000)`` is not turned into an additive mask (adding
    −10000 is not selecting); the reason names the fill."""
    from onnxscript.rewriter import RewriteRuleSet

    from tfgraph.passes.recognize.attention.rules import MASK_RULES
    from tfgraph.passes.rewrite_utils import apply_rules

    model = ir.from_onnx_text("""
    <ir_version: 10, opset_import: ["" : 20]>
    g (float[2, 4] a, float[4, 3] b, bool[2, 3] keep) => (float[2, 3] p) {
        s = MatMul (a, b)
        fill = Constant <value = float {-10000.0}> ()
        m = Where (keep, s, fill)
        p = Softmax <axis: int = -1> (m)
    }
    """)
    assert apply_rules(model, RewriteRuleSet(MASK_RULES)) == 0
    minus_inf = ir.from_onnx_text(ir.to_onnx_text(model).replace("-10000", "-inf"))
    assert apply_rules(minus_inf, RewriteRuleSet(MASK_RULES)) == 1


# slow (onnx, tensorrt): 10 s each, the graph the ort case runs, lowered for the standard
# target and statically checked for tensorrt
SOFTCAP_TARGETS = [
    "ort",
    pytest.param("onnx", marks=pytest.mark.slow),
    pytest.param("tensorrt", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("target", SOFTCAP_TARGETS)
def test_softcapped_scores_with_alternating_windows_fuse_and_cache(target, tmp_path):
    """Gemma 2's ``cap · tanh(scores / cap)`` before the mask, windowed and global layers in
    turn: fused into ``softcap`` (GroupQueryAttention's and Attention-23's attribute; for
    TensorRT tanh in the standard ops, reported missed), cached, greedy tokens equal eager."""
    source = from_module(idiom_models.softcap_gpt(), origin="idiom:softcap_gpt")
    result = tfgraph.export(source, tmp_path / "art", target=target, kv_cache=True)
    attention = result.report["fusions"]["attention"]
    if target == "tensorrt":  # standard ops with tanh: not claimed as TensorRT's fused MHA
        assert (attention["fused"], attention["total"]) == (0, 4)
        assert {m["reason"] for m in attention["missed"]} == {SOFTCAP_MISS}
    else:
        assert (attention["fused"], attention["total"]) == (4, 4), attention["missed"]
    assert result.passed and result.report["parity"]["decode"]["passed"]
    model = ir.load(tmp_path / "art" / "model.onnx")
    if target == "ort":
        gqa = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
        assert [n.attributes["softcap"].value for n in gqa] == [5.0] * 4
        windows = [n.attributes.get_int("local_window_size", -1) for n in gqa]
        assert windows == [3, -1, 3, -1]
    decoder = CachedDecoder(Session(tmp_path / "art"))
    assert compare_greedy(source, decoder, PROMPTS, 6).passed


def test_a_tanh_not_scaled_by_its_cap_is_not_a_softcap():
    """Rejection: ``5 · tanh(scores / 4)`` is not a soft-cap; attention stays unfused, and the
    report says why."""
    from tfgraph.exporters.compile import count_fusions, run_pipeline
    from tfgraph.sources.trace import trace

    model = idiom_models.softcap_gpt()
    for block in model.blocks:  # tanh(s / 4) · 5
        block.attn.forward = _broken_cap(block.attn)
    traced = trace(from_module(model, origin="idiom:broken_cap"))
    run_pipeline(traced, "default")
    attention = count_fusions(traced)["attention"]
    assert attention["fused"] == 0 and attention["total"] == 4
    reasons = {m["reason"] for m in attention["missed"]}
    assert reasons == {"tanh's input is not scaled by 1/cap of its output"}, reasons


def test_a_term_inside_the_cap_is_not_taken_as_the_bias(tmp_path):
    """Rejection: Shaw's q·r inside ``cap · tanh((q·k + q·r) / cap)`` cannot become the fused
    op's bias (added after the cap; the fuzzer found the 2e-4 parity drift): not fused, the
    reason reported, parity kept by the standard ops."""
    from tfgraph.models import ModelConfig, build

    cfg = ModelConfig(
        d_model=32,
        n_heads=4,
        n_layers=2,
        vocab_size=64,
        max_seq_len=64,
        positions="shaw",
        softcap=20.0,
        scale_scores=False,
    )
    result = tfgraph.export(from_module(build(cfg), origin="zoo:shaw-softcap"), tmp_path / "a")
    attention = result.report["fusions"]["attention"]
    assert (attention["fused"], attention["total"]) == (0, 2)
    reasons = {m["reason"] for m in attention["missed"]}
    assert reasons == {
        "an extra score term (Shaw's q·r) inside the soft-cap: the capped op adds its bias "
        "after the tanh"
    }, reasons
    assert result.passed


def _broken_cap(attn):
    import torch

    def forward(x):
        B, T, C = x.shape
        q = attn.q(x).view(B, T, attn.h, attn.hs).transpose(1, 2) * attn.hs**-0.5
        k = attn.k(x).view(B, T, attn.kv, attn.hs).transpose(1, 2)
        v = attn.v(x).view(B, T, attn.kv, attn.hs).transpose(1, 2)
        k = k.repeat_interleave(attn.h // attn.kv, dim=1)
        v = v.repeat_interleave(attn.h // attn.kv, dim=1)
        scores = torch.tanh((q @ k.transpose(-2, -1)) / 4.0) * 5.0
        y = torch.softmax(scores, dim=-1) @ v
        return attn.o(y.transpose(1, 2).reshape(B, T, C))

    return forward


def test_min_dims_within_the_position_limit_are_the_sequence():
    """``Min(N, sequence)`` (a buffer of N rows sliced to the input) is named ``sequence`` when
    N is at least the model's position limit, and kept when it is below it."""
    from tfgraph.sources.trace import _bounded_dims

    def model_with(dim: str) -> ir.Model:
        x = ir.Value(
            name="x", shape=ir.Shape(["batch", "sequence"]), type=ir.TensorType(ir.DataType.FLOAT)
        )
        node = ir.Node("", "Identity", [x])
        node.outputs[0].shape = ir.Shape(["batch", dim])
        graph = ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 20})
        return ir.Model(graph, ir_version=10)

    for dim, limit, want in (
        ("Min(256, sequence)", 256, "sequence"),
        ("Min(sequence, 512)", 256, "sequence"),
        ("Min(128, sequence)", 256, "Min(128, sequence)"),
    ):
        model = model_with(dim)
        _bounded_dims(model, limit)
        assert str(model.graph.outputs[0].shape[1]) == want


@pytest.mark.parametrize(
    ("mix", "what"),
    [("conv", "Conv along the sequence mixes the tokens"), ("cumsum", "cumulative sum over")],
)
def test_token_mixing_outside_attention_refuses_the_kv_cache(mix, what, tmp_path):
    """Rejection: a layer that mixes tokens outside attention (a convolution along the
    sequence, a running sum) keeps state a KV cache of attention alone would drop: the cache is
    refused with a reason naming the layer, and nothing is written; without the cache the
    export keeps parity."""
    source = from_module(idiom_models.mix_gpt(mix), origin=f"idiom:mix_gpt:{mix}")
    with pytest.raises(tfgraph.TfgraphError, match=f"{what}.*export without --kv-cache"):
        tfgraph.export(source, tmp_path / "cached", kv_cache=True)
    assert not (tmp_path / "cached").exists()
    result = tfgraph.export(source, tmp_path / "plain")
    assert result.passed
    attention = result.report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == 2


def test_a_router_with_an_expert_scattered_out_is_a_gate():
    """PhiMoE's sparse mixer: the second softmax reads the router logits with the top-1
    expert set to -inf by ScatterElements; still a gate (not an attention candidate)."""
    from tfgraph.passes.recognize.attention.fuse import is_gating_softmax

    model = ir.from_onnx_text("""
    <ir_version: 10, opset_import: ["" : 20]>
    g (float[6, 8] x) => (float[6, 4] second) {
        w = Constant <value = float[8, 4] {1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0,
            4.0, 1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0,
            1.0, 2.0, 3.0, 4.0}> ()
        logits = MatMul (x, w)
        top = ArgMax <axis: int = -1, keepdims: int = 1> (logits)
        minus_inf = Constant <value = float[6, 1] {-inf, -inf, -inf, -inf, -inf, -inf}> ()
        rest = ScatterElements <axis: int = -1> (logits, top, minus_inf)
        second = Softmax <axis: int = -1> (rest)
    }
    """)
    ir.passes.common.ShapeInferencePass()(model)
    (second,) = (n for n in model.graph if n.op_type == "Softmax")
    assert is_gating_softmax(second)


def test_positions_from_a_sliced_buffer_cache_when_the_limit_is_stated(tmp_path):
    """``position_ids[:, :T]`` of a 64-row buffer: with the model's position limit stated the
    axis is the sequence and the cache is exact; without it the KV cache is refused with the
    reason (it used to write a cache whose decode steps read the wrong positions)."""
    source = from_module(idiom_models.buffer_pos_gpt(True), origin="idiom:buffer_pos_gpt")
    result = tfgraph.export(source, tmp_path / "limit", kv_cache=True)
    assert result.passed and result.report["parity"]["decode"]["passed"]
    assert compare_greedy(source, CachedDecoder(Session(tmp_path / "limit")), PROMPTS, 6).passed
    unstated = from_module(idiom_models.buffer_pos_gpt(False), origin="idiom:buffer_pos_gpt")
    with pytest.raises(tfgraph.TfgraphError, match=r"sequence axis of Min\(64, sequence\)"):
        tfgraph.export(unstated, tmp_path / "unstated", kv_cache=True)
    assert not (tmp_path / "unstated").exists()


def test_one_softmax_feeding_two_values_fuses_twice_and_caches(tmp_path):
    """DiffLlama's form: two attention calls on the same Q and K, merged by CSE into one
    softmax with two ·V products; each product gets its own copy of the chain and fuses (2 per
    layer), the cache and greedy tokens equal eager."""
    source = from_module(idiom_models.two_value_gpt(), origin="idiom:two_value_gpt")
    result = tfgraph.export(source, tmp_path / "art", kv_cache=True)
    attention = result.report["fusions"]["attention"]
    assert (attention["fused"], attention["total"]) == (4, 4), attention["missed"]
    assert result.passed and result.report["parity"]["decode"]["passed"]
    model = ir.load(tmp_path / "art" / "model.onnx")
    assert sum(n.op_type == "GroupQueryAttention" for n in model.graph) == 4
    decoder = CachedDecoder(Session(tmp_path / "art"))
    assert compare_greedy(source, decoder, PROMPTS, 6).passed


def test_an_additive_mask_built_with_where_is_not_taken_for_a_selection(tmp_path):
    """Rejection (a regression the fuzz campaign caught at once): the zoo's additive causal
    mask ``scores + Where(future, -inf, zeros)`` must not be read as a selection of the zeros
    with the scores as a later bias; the selected value must come from Q·Kᵀ."""
    from tfgraph.models.config import ModelConfig
    from tfgraph.passes.recognize.attention.rules import _from_scores
    from tfgraph.tools.fuzz_cases import FuzzCase, case_source

    cfg = ModelConfig(d_model=8, n_heads=1, n_layers=1, d_ff=32, norm="layernorm", ffn="relu")
    source = case_source(FuzzCase(config=cfg))
    result = tfgraph.export(source, tmp_path / "art")
    attention = result.report["fusions"]["attention"]
    assert (attention["fused"], attention["total"]) == (1, 1), attention["missed"]
    assert result.passed
    model = ir.from_onnx_text("""
    <ir_version: 10, opset_import: ["" : 20]>
    g (float[2, 3] q, float[3, 3] k, bool[2, 3] keep) => (float[2, 3] m) {
        zero = Constant <value = float {0.0}> ()
        shape = Constant <value = int64[2] {2, 3}> ()
        zeros = Expand (zero, shape)
        s = MatMul (q, k)
        m = Where (keep, zeros, s)
    }
    """)
    zeros, s = (n.outputs[0] for n in model.graph if n.op_type in ("Expand", "MatMul"))
    assert _from_scores(s) and not _from_scores(zeros)
