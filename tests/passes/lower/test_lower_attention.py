"""Lowering of ``tfgraph.Attention``: op choice per target, then numbers against numpy.

Each test builds one canonical node by hand, lowers it, asserts the ops produced, and runs the
result in ONNX Runtime (its own graph optimizations off) against :func:`reference_attention`.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import pytest
from ort_run import run_onnx

from tfgraph.exporters.targets import get_target
from tfgraph.passes.lower.lower_attention import LowerAttentionPass
from tfgraph.passes.rewrite_utils import MISS_REASON_KEY

B, D = 2, 16
ATOL = 1e-5
OPSET = {"ort": 20, "onnx": 23, "tensorrt": 23}
GQA = ("com.microsoft", "GroupQueryAttention")
MHA = ("com.microsoft", "MultiHeadAttention")
ATTENTION = ("", "Attention")
SCOPE = {"pkg.torch.onnx.name_scopes": "['', 'layers.0', 'layers.0.attn']"}


def reference_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    bias: np.ndarray | None = None,
    *,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
    causal: int = 0,
    causal_alignment: str = "bottom_right",
    window: int = 0,
    bias_kind: str = "none",
) -> np.ndarray:
    """``tfgraph.Attention`` in float64 numpy, straight from the op's definition."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    t, s = q.shape[2], k.shape[2]
    group = num_heads // kv_num_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # head h uses h // group
    scores = scale * q @ k.swapaxes(-1, -2)  # (B, Hq, T, S)
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    visible = np.ones((t, s), dtype=bool)
    if causal:
        visible &= j <= i + (s - t if causal_alignment == "bottom_right" else 0)
    if window:
        visible &= (i + s - t) - j < window
    scores = np.where(visible, scores, -np.inf)
    if bias is not None:
        scores = scores + bias
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    return probs / probs.sum(axis=-1, keepdims=True) @ v


@dataclass(frozen=True)
class Case:
    t: int
    s: int
    causal: int = 0
    alignment: str = "bottom_right"
    window: int = 0
    bias: str = "none"  # none, padding, alibi, relative
    ort_op: tuple[str, str] = GQA  # at opset 20
    onnx_is_causal: int = 0  # does Attention-23 get is_causal=1 (else a mask, if any)?


CASES = {
    "bidirectional": Case(6, 6, ort_op=MHA),
    "causal": Case(6, 6, causal=1, onnx_is_causal=1),
    "causal_top_left": Case(6, 6, causal=1, alignment="top_left", onnx_is_causal=1),
    "cross": Case(4, 9, ort_op=MHA),
    "causal_s_gt_t": Case(4, 9, causal=1, ort_op=MHA),
    "causal_top_left_s_gt_t": Case(
        4, 9, causal=1, alignment="top_left", ort_op=MHA, onnx_is_causal=1
    ),
    "window": Case(9, 9, causal=1, window=3),
    "window_s_gt_t": Case(4, 9, causal=1, window=3, ort_op=MHA),
    "window_bidirectional": Case(7, 7, window=3),
    "padding": Case(6, 6, bias="padding"),
    "padding_causal": Case(6, 6, causal=1, bias="padding", onnx_is_causal=1),
    "padding_cross": Case(4, 9, bias="padding", ort_op=MHA),
    "alibi_causal": Case(6, 6, causal=1, bias="alibi", onnx_is_causal=1),
    "alibi_s_gt_t": Case(4, 9, causal=1, bias="alibi", ort_op=MHA),
    "relative": Case(6, 6, bias="relative"),
    "relative_causal_window": Case(8, 8, causal=1, window=4, bias="relative"),
}
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (8, 1)}


def make_bias(case: Case, hq: int, rng: np.random.Generator) -> np.ndarray | None:
    t, s = case.t, case.s
    if case.bias == "padding":  # (B, 1, 1, S): batch 1 pads its last two keys
        bias = np.zeros((B, 1, 1, s), np.float32)
        bias[1, ..., -2:] = -np.inf
        return bias
    if case.bias == "alibi":  # (1, Hq, T, S): slope_h · (j − i − (S − T))
        slopes = 2.0 ** (-8.0 * np.arange(1, hq + 1) / hq)
        distance = np.arange(s)[None, :] - np.arange(t)[:, None] - (s - t)
        return (slopes[:, None, None] * distance)[None].astype(np.float32)
    if case.bias == "relative":  # (1, Hq, T, S): a learned table, here random
        return rng.standard_normal((1, hq, t, s)).astype(np.float32)
    return None


def build(
    case: Case,
    hq: int,
    hkv: int,
    opset: int,
    *,
    seq: tuple | None = None,
    bias_shape: tuple | None = None,
) -> ir.Model:
    """One graph: graph inputs Q, K, V (and bias) → tfgraph.Attention → Y."""
    t, s = seq or (case.t, case.s)
    q = ir.val("Q", ir.DataType.FLOAT, [B, hq, t, D])
    k = ir.val("K", ir.DataType.FLOAT, [B, hkv, s, D])
    v = ir.val("V", ir.DataType.FLOAT, [B, hkv, s, D])
    inputs = [q, k, v]
    if case.bias != "none":
        shape = bias_shape or ((B, 1, 1, s) if case.bias == "padding" else (1, hq, t, s))
        inputs.append(ir.val("bias", ir.DataType.FLOAT, list(shape)))
    bias_kind = {"alibi": "alibi", "relative": "relative", "padding": "padding"}
    attrs = {
        "num_heads": hq,
        "kv_num_heads": hkv,
        "scale": 0.3,
        "causal": case.causal,
        "causal_alignment": case.alignment,
        "window": case.window,
        "bias_kind": bias_kind.get(case.bias, "none"),
    }
    node = ir.node(
        "Attention", inputs, attrs, domain="tfgraph", name="attn", metadata_props=dict(SCOPE)
    )
    y = node.outputs[0]
    y.name, y.dtype, y.shape = "Y", ir.DataType.FLOAT, ir.Shape([B, hq, t, D])
    graph = ir.Graph(
        inputs, [y], nodes=[node], opset_imports={"": opset, "tfgraph": 1}, name="attention"
    )
    return ir.Model(graph, ir_version=10)


def feeds(case: Case, hq: int, hkv: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    data = {
        "Q": rng.standard_normal((B, hq, case.t, D)).astype(np.float32),
        "K": rng.standard_normal((B, hkv, case.s, D)).astype(np.float32),
        "V": rng.standard_normal((B, hkv, case.s, D)).astype(np.float32),
    }
    bias = make_bias(case, hq, rng)
    if bias is not None:
        data["bias"] = bias
    return data


def expected(case: Case, hq: int, hkv: int, data: dict[str, np.ndarray]) -> np.ndarray:
    return reference_attention(
        data["Q"],
        data["K"],
        data["V"],
        data.get("bias"),
        num_heads=hq,
        kv_num_heads=hkv,
        scale=0.3,
        causal=case.causal,
        causal_alignment=case.alignment,
        window=case.window,
    )


def run_ort(model: ir.Model, data: dict[str, np.ndarray]) -> np.ndarray:
    return run_onnx(model, data, optimize=False)[0]


def ops(model: ir.Model) -> Counter:
    return Counter((n.domain, n.op_type) for n in model.graph)


def lower(model: ir.Model, target: str) -> ir.Model:
    result = LowerAttentionPass(get_target(target))(model)
    assert result.modified
    assert LowerAttentionPass(get_target(target))(result.model).modified is False
    return result.model


def check_structure(model: ir.Model, target: str, case: Case) -> None:
    histogram = ops(model)
    assert not [op for op in histogram if op[0] == "tfgraph"]
    for node in model.graph:  # reports keep the PyTorch module name
        assert (
            node.metadata_props.get("pkg.torch.onnx.name_scopes")
            == SCOPE["pkg.torch.onnx.name_scopes"]
        )
    if target == "ort":
        assert histogram[case.ort_op] == 1
        assert model.opset_imports.get("com.microsoft") == 1
    elif target == "onnx":
        assert histogram[ATTENTION] == 1
        assert not [op for op in histogram if op[0] == "com.microsoft"]
        node = next(n for n in model.graph if n.op_type == "Attention")
        assert node.attributes.get_int("is_causal") == case.onnx_is_causal
        has_mask = len(node.inputs) > 3 and node.inputs[3] is not None
        needs_mask = case.bias != "none" or (case.causal and not case.onnx_is_causal)
        assert has_mask == bool(needs_mask or case.window)
    else:
        check_tensorrt(model)


def check_tensorrt(model: ir.Model) -> None:
    """Standard ops only, scale as Mul on Q ahead of the first MatMul, Softmax on the last axis."""
    histogram = ops(model)
    assert not [op for op in histogram if op[0] not in ("", "ai.onnx")]
    assert histogram[ATTENTION] == 0
    assert histogram[("", "MatMul")] == 2 and histogram[("", "Softmax")] == 1
    first = next(n for n in model.graph if n.op_type == "MatMul")
    scaled = first.inputs[0].producer()
    assert scaled is not None and scaled.op_type == "Mul"
    assert scaled.inputs[0].name == "Q"
    assert np.allclose(scaled.inputs[1].const_value.numpy(), 0.3)
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    assert softmax.attributes.get_int("axis") == -1


@pytest.mark.parametrize("target", ["ort", "onnx", "tensorrt"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("name", list(CASES))
def test_lowering_matches_reference(name: str, heads: str, target: str) -> None:
    case, (hq, hkv) = CASES[name], HEADS[heads]
    model = lower(build(case, hq, hkv, OPSET[target]), target)
    check_structure(model, target, case)
    data = feeds(case, hq, hkv)
    np.testing.assert_allclose(run_ort(model, data), expected(case, hq, hkv, data), atol=ATOL)


def test_ort_window_is_local_window_size() -> None:
    """Measured: GQA's local_window_size W lets query p see keys p − W + 1 … p, as ours."""
    model = lower(build(CASES["window"], 8, 2, 20), "ort")
    node = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    assert node.attributes.get_int("local_window_size") == 3
    assert node.attributes.get_int("causal") == 1
    assert len(node.inputs) <= 7  # the window needs no attention_bias


def test_padding_bias_gets_a_full_query_axis() -> None:
    """ORT's fused kernels reject a bias broadcast over the query axis: it is expanded."""
    case = CASES["padding"]
    model = lower(build(case, 4, 4, 20), "ort")
    gqa = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    assert gqa.inputs[10].producer().op_type == "Expand"
    data = feeds(case, 4, 4)
    np.testing.assert_allclose(run_ort(model, data), expected(case, 4, 4, data), atol=ATOL)


def test_full_bias_is_passed_through() -> None:
    model = lower(build(CASES["relative"], 8, 2, 20), "ort")
    gqa = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    assert gqa.inputs[10].name == "bias"


@pytest.mark.parametrize(
    ("name", "kv_seq", "ort_op", "onnx_is_causal"),
    [("alibi_causal", "seq", GQA, 1), ("alibi_s_gt_t", "kv_seq", MHA, 0)],
    ids=["same-symbol", "other-symbol"],
)
def test_symbolic_lengths(
    name: str, kv_seq: str, ort_op: tuple[str, str], onnx_is_causal: int
) -> None:
    """S == T is proved only by the same named dim; otherwise the mask is built from shapes."""
    case = CASES[name]
    data = feeds(case, 8, 2)
    for target in ("ort", "onnx", "tensorrt"):
        seq = ("seq", kv_seq)
        model = build(case, 8, 2, OPSET[target], seq=seq, bias_shape=(1, 8, *seq))
        model = lower(model, target)
        if target == "ort":
            assert ops(model)[ort_op] == 1
        if target == "onnx":
            node = next(n for n in model.graph if n.op_type == "Attention")
            assert node.attributes.get_int("is_causal") == onnx_is_causal
        np.testing.assert_allclose(run_ort(model, data), expected(case, 8, 2, data), atol=ATOL)


def test_onnx_below_opset_23_decomposes_and_reports() -> None:
    case = CASES["causal_s_gt_t"]
    model = lower(build(case, 8, 2, 20), "onnx")
    check_tensorrt(model)
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    assert "opset 23" in softmax.metadata_props[MISS_REASON_KEY]
    data = feeds(case, 8, 2)
    np.testing.assert_allclose(run_ort(model, data), expected(case, 8, 2, data), atol=ATOL)


def test_graph_without_attention_is_unmodified() -> None:
    x = ir.val("x", ir.DataType.FLOAT, [2])
    node = ir.node("Relu", [x])
    graph = ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 20})
    assert LowerAttentionPass(get_target("ort"))(ir.Model(graph, ir_version=10)).modified is False


def test_a_pass_takes_a_target_not_a_name() -> None:
    with pytest.raises(TypeError, match=r"get_target\('ort'\)"):
        LowerAttentionPass("ort")


def test_reference_matches_a_loop() -> None:
    """The reference itself, against a per-head, per-query loop (GQA, bottom-right, window)."""
    rng = np.random.default_rng(3)
    hq, hkv, t, s, window = 6, 2, 3, 7, 3
    q = rng.standard_normal((1, hq, t, D))
    k, v = rng.standard_normal((2, 1, hkv, s, D))
    bias = rng.standard_normal((1, hq, t, s))
    got = reference_attention(
        q, k, v, bias, num_heads=hq, kv_num_heads=hkv, scale=0.25, causal=1, window=window
    )
    for h in range(hq):
        kv = h // (hq // hkv)
        for i in range(t):
            keys = [j for j in range(s) if j <= i + s - t and (i + s - t) - j < window]
            logits = np.array([0.25 * q[0, h, i] @ k[0, kv, j] + bias[0, h, i, j] for j in keys])
            weights = np.exp(logits - logits.max())
            want = (weights / weights.sum()) @ v[0, kv, keys]
            np.testing.assert_allclose(got[0, h, i], want, atol=1e-12)


def test_ort_head_size_not_multiple_of_8_uses_mha(monkeypatch) -> None:
    """GroupQueryAttention's CPU kernel refuses head sizes that are not multiples of 8
    (Llama-2-70B-tiny has 2): such layers take MultiHeadAttention with the mask."""
    monkeypatch.setattr(sys.modules[__name__], "D", 2)
    case = CASES["causal"]
    model = lower(build(case, 8, 2, 20), "ort")
    assert ops(model)[MHA] == 1 and ops(model)[GQA] == 0
    data = feeds(case, 8, 2)
    np.testing.assert_allclose(run_ort(model, data), expected(case, 8, 2, data), atol=ATOL)


@pytest.mark.parametrize("name", ["causal", "window", "alibi_causal"])
def test_gqa_declares_present_outputs(name: str) -> None:
    """ORT 1.32's CPU GroupQueryAttention stays on its O(n)-memory path only when the node
    declares present_key/present_value (measured: +2118 MiB at 8192 without them, +7 MiB with
    them; docs/attention-lowering.md), so the lowering declares them although unused."""
    case = CASES[name]
    model = lower(build(case, 8, 2, 20), "ort")
    (node,) = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    assert len(node.outputs) == 3
    assert not node.outputs[1].uses() and not node.outputs[2].uses()
    data = feeds(case, 8, 2)
    np.testing.assert_allclose(run_ort(model, data), expected(case, 8, 2, data), atol=ATOL)
