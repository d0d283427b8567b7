"""Standard-ONNX lowerings of ``tfgraph.LinearAttention`` and ``tfgraph.CausalConv``
(:mod:`tfgraph.passes.lower.recurrent_standard`) against numpy, next to ONNX Runtime's contrib ops.

Each case builds two small models with symbolic B and T: one holding the
``com.microsoft`` op (``contrib``), one holding the canonical node lowered by the builder
(``standard``), and runs both in ONNX Runtime on the CPU, graph optimizations off, against a
float64 numpy recurrence written from ONNX Runtime's documented semantics.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from ort_run import run_onnx

from tfgraph.passes.canonical import DOMAIN, CausalConvOp, LinearAttentionOp
from tfgraph.passes.lower.recurrent_standard import standard_causal_conv, standard_linear_attention
from tfgraph.passes.rewrite_utils import insert_tape, replace_value

B, H, DK, DV, C = 2, 3, 4, 5, 6
ATOL = RTOL = 1e-5
MS = "com.microsoft"
F32, F16 = ir.DataType.FLOAT, ir.DataType.FLOAT16
IMPLS = ("contrib", "standard")
# What the standard lowerings may contain: ops TensorRT's ONNX parser imports.
STANDARD_OPS = {
    "Cast", "Concat", "ConstantOfShape", "Conv", "Exp", "MatMul", "Mul", "Reshape", "Scan",
    "Shape", "Sigmoid", "Slice", "Sub", "Add", "Transpose", "Sqrt", "Reciprocal",
}  # fmt: skip
# (update_rule, decay layout): decay per head (B, T, H) or per key dim (B, T, H·dk).
VARIANTS = [
    ("linear", None),
    ("delta", None),
    ("gated", "head"),
    ("gated", "key"),
    ("gated_delta", "head"),
    ("gated_delta", "key"),
]


# -- numpy references ------------------------------------------------------------------------
def reference_linear_attention(
    q, k, v, past, decay, beta, *, q_heads: int, kv_heads: int, rule: str, scale: float
):
    """(y, state) of ``LinearAttention`` in float64, token by token, as ORT's doc writes it:
    S_t = a_t·S + β_t·k_t ⊗ (v_t − a_t·Sᵀk_t) (a = e^g or 1, β·(…) = v_t without a delta
    rule), o_t = scale·q_tᵀS_t; query head h reads state h // (Hq / H)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    b, t, _ = q.shape
    dk, dv = k.shape[-1] // kv_heads, v.shape[-1] // kv_heads
    group = q_heads // kv_heads
    q = q.reshape(b, t, kv_heads, group, dk)
    k, v = k.reshape(b, t, kv_heads, dk), v.reshape(b, t, kv_heads, dv)
    s = np.zeros((b, kv_heads, dk, dv)) if past is None else past.astype(np.float64)
    scale = scale or 1 / np.sqrt(dk)
    ys = []
    for i in range(t):
        if rule in ("gated", "gated_delta"):  # g: (B, H, dk or 1)
            s = np.exp(decay.astype(np.float64).reshape(b, t, kv_heads, -1)[:, i])[..., None] * s
        kt, vt = k[:, i], v[:, i]
        if rule in ("delta", "gated_delta"):  # β: (B, H or 1)
            bt = beta.astype(np.float64).reshape(b, t, -1)[:, i][..., None]
            vt = bt * (vt - np.einsum("bhk,bhkv->bhv", kt, s))
        s = s + kt[..., :, None] * vt[..., None, :]
        ys.append(scale * np.einsum("bhgk,bhkv->bhgv", q[:, i], s))
    return np.stack(ys, axis=1).reshape(b, t, -1), s


def reference_causal_conv(x, weight, bias, past, activation: str):
    """(y, present) of ``CausalConvWithState``: y_t = act(Σ_j w_j·x_{t−K+1+j} + b) over
    ``Concat(past or zeros, x)``; present is its last K − 1 columns."""
    x, weight = x.astype(np.float64), weight.astype(np.float64)
    b, c, t = x.shape
    kernel = weight.shape[-1]
    past = np.zeros((b, c, kernel - 1)) if past is None else past.astype(np.float64)
    padded = np.concatenate([past, x], axis=2)
    y = np.stack(
        [np.sum(padded[:, :, i : i + kernel] * weight[:, 0], axis=-1) for i in range(t)], -1
    )
    if bias is not None:
        y = y + bias[:, None]
    if activation == "silu":
        y = y / (1 + np.exp(-y))
    return y, padded[:, :, -(kernel - 1) :]


# -- model building --------------------------------------------------------------------------
def _input(name: str, shape, dtype=F32) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype))


def _weight(name: str, array: np.ndarray) -> ir.Value:
    tensor = ir.tensor(array.astype(np.float32), name=name)
    return ir.Value(
        name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor
    )


def _node(domain: str, op: str, inputs: list, attrs: dict) -> ir.Node:
    """A two-output node; trailing absent inputs dropped, inner ones left empty."""
    while inputs[-1] is None:
        inputs = inputs[:-1]
    return ir.Node(domain, op, inputs, ir.convenience.convert_attributes(attrs), num_outputs=2)


def _model(node: ir.Node, shapes, lower=None, dtype=F32) -> ir.Model:
    """A graph of ``node`` alone (its outputs of ``shapes``); ``lower(tape, node)`` replaces
    it by what it builds, as a lowering pass would."""
    given = [v for v in node.inputs if v is not None]
    graph = ir.Graph(
        [v for v in given if v.const_value is None],
        list(node.outputs),
        nodes=[node],
        initializers=[v for v in given if v.const_value is not None],
        opset_imports={"": 23, MS: 1},
        name="g",
    )
    for out, shape in zip(node.outputs, shapes, strict=True):
        out.type, out.shape = ir.TensorType(dtype), ir.Shape(shape)
    if lower is not None:
        tape = ir.tape.Tape()
        new = lower(tape, node)
        insert_tape(graph, node, tape)
        for old, value in zip(node.outputs, new, strict=True):
            replace_value(old, value)
        graph.remove(node, safe=True)
        del graph.opset_imports[MS]
    return ir.Model(graph, ir_version=10)


def _run(model: ir.Model, feeds: dict) -> list[np.ndarray]:
    return run_onnx(model, feeds, optimize=False)


def _check_standard(model: ir.Model) -> None:
    """Only default-domain ops TensorRT imports, and valid for the ONNX checker at opset 23."""
    ops = {(n.domain, n.op_type) for n in ir.traversal.RecursiveGraphIterator(model.graph)}
    assert {domain for domain, _ in ops} <= {""}, ops
    assert {op for _, op in ops} <= STANDARD_OPS, ops
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)


def linear_attention_model(
    impl, *, rule, decay, beta, past, q_heads=H, scale=0.5, beta_width=H, q_width=None, dtype=F32
):
    """The model of one ``LinearAttention`` (``contrib`` or ``standard``) and the names of its
    inputs; ``q_width`` overrides q's last dim (a name: symbolic)."""
    inputs = [
        _input("q", ["B", "T", q_width or q_heads * DK], dtype),
        _input("k", ["B", "T", H * DK], dtype),
        _input("v", ["B", "T", H * DV], dtype),
        _input("past_state", ["B", H, DK, DV], dtype) if past else None,
        _input("decay", ["B", "T", H * (DK if decay == "key" else 1)], dtype) if decay else None,
        _input("beta", ["B", "T", beta_width], dtype) if beta else None,
    ]
    spec = LinearAttentionOp(q_num_heads=q_heads, kv_num_heads=H, update_rule=rule, scale=scale)
    shapes = [["B", "T", q_heads * DV], ["B", H, DK, DV]]
    if impl == "contrib":
        attrs = {"q_num_heads": q_heads, "kv_num_heads": H, "update_rule": rule, "scale": scale}
        model = _model(_node(MS, "LinearAttention", inputs, attrs), shapes)
    else:
        node = _node(DOMAIN, "LinearAttention", inputs, spec.attributes())
        model = _model(node, shapes, partial(standard_linear_attention, spec=spec), dtype)
        _check_standard(model)
    return model, [v.name for v in inputs if v is not None]


def linear_attention_feeds(t, *, q_heads=H, decay=None, past=False, beta_width=H, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, t, H, DK))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # L2-normalized, as the delta rules want
    feeds = {
        "q": rng.standard_normal((B, t, q_heads * DK)),
        "k": k.reshape(B, t, H * DK),
        "v": rng.standard_normal((B, t, H * DV)),
        "past_state": rng.standard_normal((B, H, DK, DV)) if past else None,
        # log-space decay: −softplus(x) = log σ(−x) < 0
        "decay": -np.logaddexp(0, rng.standard_normal((B, t, H * (DK if decay == "key" else 1)))),
        "beta": 1 / (1 + np.exp(-rng.standard_normal((B, t, beta_width)))),
    }
    return {name: value.astype(np.float32) for name, value in feeds.items() if value is not None}


def _reference_for(feeds, *, rule, q_heads=H, scale=0.5):
    return reference_linear_attention(
        feeds["q"], feeds["k"], feeds["v"], feeds.get("past_state"), feeds.get("decay"),
        feeds.get("beta"), q_heads=q_heads, kv_heads=H, rule=rule, scale=scale,
    )  # fmt: skip


# -- LinearAttention -------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("past", [True, False], ids=["past", "no_past"])
@pytest.mark.parametrize("t", [1, 7], ids=["T1", "T7"])
@pytest.mark.parametrize(("rule", "decay"), VARIANTS, ids=[f"{r}-{d}" for r, d in VARIANTS])
def test_linear_attention(impl, rule, decay, t, past):
    delta = rule in ("delta", "gated_delta")
    model, names = linear_attention_model(impl, rule=rule, decay=decay, beta=delta, past=past)
    feeds = linear_attention_feeds(t, decay=decay, past=past)
    y, state = _run(model, {n: feeds[n] for n in names})
    want_y, want_state = _reference_for({n: feeds[n] for n in names}, rule=rule)
    assert y.shape == (B, t, H * DV) and state.shape == (B, H, DK, DV)
    np.testing.assert_allclose(y, want_y, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(state, want_state, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_linear_attention_default_scale(impl):
    """``scale`` 0 is 1/√dk."""
    model, names = linear_attention_model(
        impl, rule="gated_delta", decay="head", beta=True, past=True, scale=0.0
    )
    feeds = {
        n: v for n, v in linear_attention_feeds(5, decay="head", past=True).items() if n in names
    }
    y, state = _run(model, feeds)
    want_y, want_state = _reference_for(feeds, rule="gated_delta", scale=0.0)
    np.testing.assert_allclose(y, want_y, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(state, want_state, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_linear_attention_default_scale_symbolic_width(impl):
    """``scale`` 0 with q's width unknown: the lowering reads dk with ``Shape``."""
    model, names = linear_attention_model(
        impl, rule="linear", decay=None, beta=False, past=False, scale=0.0, q_width="QW"
    )
    if impl == "standard":
        assert "Sqrt" in {n.op_type for n in model.graph}
    feeds = linear_attention_feeds(3)
    feeds = {n: feeds[n] for n in names}
    y, state = _run(model, feeds)
    want_y, want_state = _reference_for(feeds, rule="linear", scale=0.0)
    np.testing.assert_allclose(y, want_y, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(state, want_state, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rule", ["gated", "gated_delta"])
def test_linear_attention_grouped_heads(impl, rule):
    """Hq = 2·H: query head h reads state h // 2 (what ORT's doc describes)."""
    model, names = linear_attention_model(
        impl, rule=rule, decay="key", beta=rule == "gated_delta", past=True, q_heads=2 * H
    )
    feeds = linear_attention_feeds(4, q_heads=2 * H, decay="key", past=True)
    feeds = {n: feeds[n] for n in names}
    y, state = _run(model, feeds)
    want_y, want_state = _reference_for(feeds, rule=rule, q_heads=2 * H)
    assert y.shape == (B, 4, 2 * H * DV)
    np.testing.assert_allclose(y, want_y, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(state, want_state, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_linear_attention_shared_beta(impl):
    """β (B, T, 1): one update rate for every head."""
    model, names = linear_attention_model(
        impl, rule="delta", decay=None, beta=True, past=False, beta_width=1
    )
    feeds = linear_attention_feeds(6, beta_width=1)
    feeds = {n: feeds[n] for n in names}
    y, state = _run(model, feeds)
    want_y, want_state = _reference_for(feeds, rule="delta")
    np.testing.assert_allclose(y, want_y, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(state, want_state, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("decay", ["head", "key"])
def test_linear_attention_across_chunks(impl, decay):
    """T = 130 crosses ORT's default chunk_size (64) twice: its prefill path may run
    chunk-parallel; the recurrence must not change."""
    model, names = linear_attention_model(
        impl, rule="gated_delta", decay=decay, beta=True, past=True
    )
    feeds = linear_attention_feeds(130, decay=decay, past=True, seed=130)
    feeds = {n: feeds[n] for n in names}
    y, state = _run(model, feeds)
    want_y, want_state = _reference_for(feeds, rule="gated_delta")
    np.testing.assert_allclose(y, want_y, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(state, want_state, atol=ATOL, rtol=RTOL)


def test_linear_attention_float16_computes_in_float32():
    """float16 in and out; every input cast to float32 before the Scan, both outputs back."""
    model, names = linear_attention_model(
        "standard", rule="gated_delta", decay="head", beta=True, past=True, dtype=F16
    )
    casts = [n.attributes.get_int("to") for n in model.graph if n.op_type == "Cast"]
    assert sorted(casts) == sorted([F32] * 6 + [F16] * 2)
    feeds = linear_attention_feeds(7, decay="head", past=True)
    feeds = {n: feeds[n].astype(np.float16) for n in names}
    y, state = _run(model, feeds)
    want_y, want_state = _reference_for(feeds, rule="gated_delta")
    assert y.dtype == state.dtype == np.float16
    np.testing.assert_allclose(y, want_y, atol=2e-3, rtol=2e-3)  # float16 rounding of y
    np.testing.assert_allclose(state, want_state, atol=2e-3, rtol=2e-3)


def test_linear_attention_prefill_then_decode():
    """One lowered graph: prefill 7 tokens, then decode the 8th from the present state."""
    model, names = linear_attention_model(
        "standard", rule="gated_delta", decay="head", beta=True, past=True
    )
    feeds = linear_attention_feeds(8, decay="head", past=True)
    prefill = {n: feeds[n][:, :7] if n != "past_state" else feeds[n] for n in names}
    y7, state7 = _run(model, prefill)
    decode = {n: feeds[n][:, 7:] for n in names if n != "past_state"}
    y1, state8 = _run(model, {**decode, "past_state": state7})
    want_y, want_state = _reference_for(feeds, rule="gated_delta")
    np.testing.assert_allclose(np.concatenate([y7, y1], axis=1), want_y, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(state8, want_state, atol=ATOL, rtol=RTOL)


def test_linear_attention_rejects_missing_decay():
    node = ir.Node(DOMAIN, "LinearAttention", [_input("q", ["B", "T", 12])] * 3, num_outputs=2)
    spec = LinearAttentionOp(q_num_heads=H, kv_num_heads=H, update_rule="gated", scale=1.0)
    with pytest.raises(ValueError, match="lacks decay"):
        standard_linear_attention(ir.tape.Tape(), node, spec)


# -- CausalConv ------------------------------------------------------------------------------
def causal_conv_model(impl, *, kernel, activation, bias, past, rng):
    """The model of one causal conv (``contrib`` or ``standard``), its weight and bias."""
    weight = rng.standard_normal((C, 1, kernel)).astype(np.float32)
    bias_np = rng.standard_normal(C).astype(np.float32) if bias else None
    inputs = [
        _input("x", ["B", C, "T"]),
        _weight("weight", weight),
        _weight("bias", bias_np) if bias else None,
        _input("past_state", ["B", C, kernel - 1]) if past else None,
    ]
    shapes = [["B", C, "T"], ["B", C, kernel - 1]]
    spec = CausalConvOp(activation=activation)
    if impl == "contrib":
        node = _node(MS, "CausalConvWithState", inputs, {"activation": activation})
        model = _model(node, shapes)
    else:
        node = _node(DOMAIN, "CausalConv", inputs, spec.attributes())
        model = _model(node, shapes, partial(standard_causal_conv, spec=spec))
        _check_standard(model)
    return model, weight, bias_np


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t", [1, 6], ids=["T1", "T6"])
@pytest.mark.parametrize("past", [True, False], ids=["past", "no_past"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("kernel", [2, 4], ids=["K2", "K4"])
def test_causal_conv(impl, kernel, activation, bias, past, t):
    rng = np.random.default_rng(kernel * 100 + t)
    model, weight, bias_np = causal_conv_model(
        impl, kernel=kernel, activation=activation, bias=bias, past=past, rng=rng
    )
    x = rng.standard_normal((B, C, t)).astype(np.float32)
    past_np = rng.standard_normal((B, C, kernel - 1)).astype(np.float32) if past else None
    feeds = {"x": x} | ({"past_state": past_np} if past else {})
    y, present = _run(model, feeds)
    want_y, want_present = reference_causal_conv(x, weight, bias_np, past_np, activation)
    assert y.shape == (B, C, t) and present.shape == (B, C, kernel - 1)
    np.testing.assert_allclose(y, want_y, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(present, want_present, atol=ATOL, rtol=RTOL)


def test_causal_conv_prefill_then_decode():
    """One lowered graph: the present state of a prefill carries the next token's window."""
    rng = np.random.default_rng(3)
    model, weight, bias = causal_conv_model(
        "standard", kernel=4, activation="silu", bias=True, past=True, rng=rng
    )
    x = rng.standard_normal((B, C, 6)).astype(np.float32)
    past = rng.standard_normal((B, C, 3)).astype(np.float32)
    y5, present5 = _run(model, {"x": x[:, :, :5], "past_state": past})
    y1, present6 = _run(model, {"x": x[:, :, 5:], "past_state": present5})
    want_y, want_present = reference_causal_conv(x, weight, bias, past, "silu")
    np.testing.assert_allclose(np.concatenate([y5, y1], axis=2), want_y, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(present6, want_present, atol=ATOL, rtol=RTOL)
