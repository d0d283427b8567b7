"""Every rejection in :mod:`tfgraph.passes.recognize.attention.rules`, each on a tiny hand-built
graph.

Each negative graph is the positive control of its rule family with one knob turned, so that
it hits exactly one ``check`` rejection. The core rules (``AttentionRule``,
``BatchedHeadsAttentionRule``) must then leave the graph unfused, with the rejection recorded as
the ``Softmax``'s miss reason, and the graph must compute what it did before. The layout rules
(``DoubleTransposeRule``, ``SdpaKeyLayoutRule``, ``RepeatKVRule``) run on a fused core: they
must leave their layout in front of ``tfgraph.Attention`` (the reason is read back by matching
the rule on its root, since the pass records reasons only on unfused cores), and the fused graph,
lowered to standard ops, must compute what the original did. Every graph is run through the pass
twice: the second run finds nothing to do.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from ort_run import run_onnx

import tfgraph.passes.recognize.attention.rules as attention_rules
from tfgraph.exporters.targets import get_target
from tfgraph.passes.lower.lower_attention import LowerAttentionPass
from tfgraph.passes.recognize.attention.fuse import FuseAttentionPass
from tfgraph.passes.rewrite_utils import DOMAIN, MISS_REASON_KEY, diagnose

B, H, T, S, D = 2, 4, 5, 5, 8
HQ, HKV, G = 4, 2, 2  # GQA: query heads, KV heads, repeat count
OPSET = 18
ATOL = 1e-6


class Graph:
    """A tiny ONNX graph under construction; every value's declared shape is explicit.

    ``shape=None`` leaves a value's shape unknown; a string dim is symbolic. Inputs are fed
    with the array they were declared with, whatever shape they declare.
    """

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self.feeds: dict[str, np.ndarray] = {}

    def input(self, name: str, dims: tuple, shape: tuple | None | str = "same") -> str:
        array = self.rng.standard_normal(dims).astype(np.float32)
        declared = array.shape if shape == "same" else shape
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, declared))
        self.feeds[name] = array
        return name

    def const(self, values, dtype=np.float32) -> str:
        name = f"c{len(self.initializers)}"
        self.initializers.append(onnx.numpy_helper.from_array(np.asarray(values, dtype), name))
        return name

    def ints(self, values) -> str:
        return self.const(values, np.int64)

    def op(self, op_type: str, *inputs: str, shape: tuple | None, **attrs) -> str:
        name = f"{op_type.lower()}{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], name=name, **attrs))
        if shape is not None:
            self.value_info.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        return name

    def factor(self, spec, name: str) -> str:
        """A scale factor: a float or array → a constant; ``"input"`` → a graph input."""
        if isinstance(spec, str) and spec == "input":
            self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, []))
            self.feeds[name] = np.asarray(0.4, np.float32)
            return name
        return self.const(spec)

    def model(self, output: str, shape: tuple | None) -> onnx.ModelProto:
        out = helper.make_tensor_value_info(output, TensorProto.FLOAT, shape)
        graph = helper.make_graph(
            self.nodes, "g", self.inputs, [out], self.initializers, value_info=self.value_info
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 10
        return model


# -- graphs: each family's positive control, with knobs that break one check ---------------


def core_graph(
    *,
    q_dims: tuple = (B, H, T, D),
    q_shape: tuple | None | str = "same",
    kt_shape: tuple | None = (B, H, D, S),
    v_dims: tuple = (B, H, S, D),
    q_scale=None,
    k_scale=None,
    scale=(D**0.5),
    scale_op: str = "Div",
    extra: bool = False,
    axis: int = -1,
    guard=None,
):
    """``MatMul(Softmax(scale_op(MatMul([Mul](q), [Mul](Kᵀ)) [+ extra], c)), V)`` with
    ``Kᵀ = Transpose(k)``: what :class:`AttentionRule` fuses."""
    g = Graph()
    q = g.input("q", q_dims, q_shape)
    k = g.input("k", (B, H, S, D))
    v = g.input("v", v_dims)
    kt = g.op("Transpose", k, perm=[0, 1, 3, 2], shape=kt_shape)
    if q_scale is not None:
        q = g.op("Mul", q, g.factor(q_scale, "c_q"), shape=q_dims)
    if k_scale is not None:
        kt = g.op("Mul", kt, g.factor(k_scale, "c_k"), shape=(B, H, D, S))
    scores = g.op("MatMul", q, kt, shape=(B, H, T, S))
    if extra:  # an activation-dependent score term (Shaw)
        scores = g.op("Add", scores, g.input("extra", (B, H, T, S)), shape=(B, H, T, S))
    if scale is not None:
        scores = g.op(scale_op, scores, g.factor(scale, "c"), shape=(B, H, T, S))
    probs = g.op("Softmax", scores, axis=axis, shape=(B, H, T, S))
    if guard is not None:
        nan = g.op("IsNaN", probs, shape=None)
        probs = g.op("Where", nan, g.const(guard), probs, shape=(B, H, T, S))
    return g, g.op("MatMul", probs, v, shape=None), (B, H, T, D)


def bloom_graph(
    *,
    axis: int = -1,
    scale=0.3,
    q3_shape: tuple | None | str = "same",
    kt3_dims: tuple = (B * H, D, S),
    v3_dims: tuple = (B * H, S, D),
    scores4_shape: tuple | None = (B, H, T, S),
    y4_shape: tuple | None = (B, H, T, D),
):
    """BLOOM's baddbmm layout, what :class:`BatchedHeadsAttentionRule` fuses."""
    g = Graph()
    q3 = g.input("q3", (B * H, T, D), q3_shape)
    kt3, v3 = g.input("kt3", kt3_dims), g.input("v3", v3_dims)
    alibi3, mask = g.input("alibi3", (B * H, 1, S)), g.input("mask", (B, 1, T, S))
    s = g.op("MatMul", q3, kt3, shape=(B * H, T, S))
    s = g.op("Mul", s, g.factor(scale, "c"), shape=(B * H, T, S))
    s = g.op("Add", s, alibi3, shape=(B * H, T, S))
    s = g.op("Reshape", s, g.ints([B, H, T, S]), shape=scores4_shape)
    s = g.op("Add", s, mask, shape=(B, H, T, S))
    p = g.op("Softmax", s, axis=axis, shape=(B, H, T, S))
    p = g.op("Reshape", p, g.ints([B * H, T, S]), shape=(B * H, T, S))
    y = g.op("MatMul", p, v3, shape=(B * H, T, D))
    return g, g.op("Reshape", y, g.ints([B, H, T, D]), shape=None), y4_shape


def _attention_on(g: Graph, q: str, kt: str, kt_shape: tuple, v: str, bias: str | None = None):
    """The plain attention core over an already built ``q``, ``Kᵀ`` and ``V``."""
    b, h, _, s = kt_shape
    scores_shape = (b, max(g.feeds[q].shape[1], h), T, s)  # MatMul broadcasts one KV head
    scores = g.op("MatMul", q, kt, shape=scores_shape)
    scores = g.op("Div", scores, g.const(D**0.5), shape=scores_shape)
    if bias is not None:
        scores = g.op("Add", scores, bias, shape=scores_shape)
    probs = g.op("Softmax", scores, axis=-1, shape=scores_shape)
    return g.op("MatMul", probs, v, shape=None)


def transposed_key_graph(*, perm: tuple[int, ...] | None = (0, 2, 1, 3)):
    """K arrives as (B, S, H, d); ``Kᵀ = Transpose(Transpose(k, [0, 2, 1, 3]), [0, 1, 3, 2])``.
    After fusion the core's ``Transpose(Kᵀ)`` cancels against the second one
    (:class:`DoubleTransposeRule`). ``perm`` is the first transpose's; ``None``: the default
    (reversal), on a k laid out (d, S, H, B)."""
    g = Graph()
    q = g.input("q", (B, H, T, D))
    if perm is None:
        k = g.op("Transpose", g.input("k", (S, D, H, B)), shape=(B, H, D, S))  # reversed
    else:
        k = g.op("Transpose", g.input("k", (B, S, H, D)), perm=list(perm), shape=(B, H, S, D))
        k = g.op("Transpose", k, perm=[0, 1, 3, 2], shape=(B, H, D, S))
    v = g.input("v", (B, H, S, D))
    return g, _attention_on(g, q, k, (B, H, D, S), v), (B, H, T, D)


def transposed_key_graph_noncancelling():
    """K arrives as (B, S, H, d) and ``Kᵀ = Transpose(k, [0, 2, 3, 1])`` in one go: the core's
    ``Transpose(Kᵀ, [0, 1, 3, 2])`` composes with it to [0, 2, 1, 3], not the identity."""
    g = Graph()
    q = g.input("q", (B, H, T, D))
    kt = g.op("Transpose", g.input("k", (B, S, H, D)), perm=[0, 2, 3, 1], shape=(B, H, D, S))
    v = g.input("v", (B, H, S, D))
    return g, _attention_on(g, q, kt, (B, H, D, S), v), (B, H, T, D)


def sdpa_key_graph(
    *,
    k_dims: tuple = (B, H, S, D),
    k_shape: tuple | None | str = "same",
    flat: tuple = (B * H, S, D),
    kt: tuple = (B, H, D, S),
    flat_shape: tuple | None | str = "same",
    kt_shape: tuple | None | str = "same",
    v_dims: tuple = (B, H, S, D),
    v_shape: tuple | None | str = "same",
):
    """SDPA's K: ``Kᵀ = Reshape(Transpose(Reshape(k, flat), [0, 2, 1]), kt)``, which
    :class:`SdpaKeyLayoutRule` replaces by k once the core is fused. ``flat`` and ``kt`` are
    the reshape targets (ints, -1 allowed); ``*_shape`` override the declared shapes."""
    g = Graph()
    q = g.input("q", (B, H, T, D))
    k = g.input("k", k_dims, k_shape)
    declared_flat = tuple(flat) if flat_shape == "same" else flat_shape
    x = g.op("Reshape", k, g.ints(flat), shape=declared_flat)
    t_shape = None if declared_flat is None else (declared_flat[0], *declared_flat[:0:-1])
    x = g.op("Transpose", x, perm=[0, 2, 1], shape=t_shape)
    declared_kt = tuple(kt) if kt_shape == "same" else kt_shape
    x = g.op("Reshape", x, g.ints(kt), shape=declared_kt)
    v = g.input("v", v_dims, v_shape)
    return g, _attention_on(g, q, x, declared_kt, v), (B, H, T, D)


def repeat_kv_graph(
    *,
    bias: bool = False,
    kv_heads: int = HKV,
    repeat: int = G,
    k_axis: int = 2,
    v_axis: int = 2,
    k_shape: tuple | None | str = "same",
    exp_shapes: dict | None = None,
):
    """GQA: ``repeat_kv(x) = Reshape(Expand(Unsqueeze(x, [2]), …), (B, Hkv·g, S, d))`` on K
    and V (``axis`` 1: tile order instead), which :class:`RepeatKVRule` absorbs into
    ``kv_num_heads``. ``exp_shapes`` overrides the declared shape of ``"k"``'s or ``"v"``'s
    expansion."""
    g = Graph()
    q = g.input("q", (B, HQ, T, D))
    heads = kv_heads * repeat

    def repeat_kv(name, axis, shape):
        x = g.input(name, (B, kv_heads, S, D), shape)
        unsq = [B, kv_heads, S, D]
        unsq.insert(axis, 1)
        x = g.op("Unsqueeze", x, g.ints([axis]), shape=tuple(unsq))
        reps = [1] * 5
        reps[axis] = repeat
        exp = tuple(d * r for d, r in zip(unsq, reps, strict=True))
        exp = (exp_shapes or {}).get(name, exp)
        x = g.op("Expand", x, g.ints(reps), shape=exp)
        return g.op("Reshape", x, g.ints([B, heads, S, D]), shape=(B, heads, S, D))

    k = repeat_kv("k", k_axis, k_shape)
    v = repeat_kv("v", v_axis, "same")
    kt = g.op("Transpose", k, perm=[0, 1, 3, 2], shape=(B, heads, D, S))
    mask = g.input("mask", (B, 1, T, S)) if bias else None
    return g, _attention_on(g, q, kt, (B, heads, D, S), v, mask), (B, HQ, T, D)


# -- running -----------------------------------------------------------------------------------


class Run:
    """A built graph, its ONNX Runtime output, and the IR model after ``FuseAttentionPass``."""

    def __init__(self, built) -> None:
        g, output, shape = built
        self.feeds = g.feeds
        proto = g.model(output, shape)
        self.before = run_onnx(proto, self.feeds, optimize=False)[0]
        self.model = ir.from_proto(proto)
        self.modified = FuseAttentionPass()(self.model).modified
        assert not FuseAttentionPass()(self.model).modified  # a second run finds nothing to do

    def nodes(self, op_type: str, domain: str = "") -> list[ir.Node]:
        return [n for n in self.model.graph if n.op_type == op_type and n.domain == domain]

    def attention(self) -> ir.Node:
        (node,) = self.nodes("Attention", DOMAIN)
        return node

    def miss_reason(self) -> str:
        (softmax,) = self.nodes("Softmax")
        return softmax.metadata_props.get(MISS_REASON_KEY, "")

    def assert_unchanged_numbers(self) -> None:
        """The graph has no tfgraph op left: it runs as is and computes what it did."""
        assert not self.nodes("Attention", DOMAIN)
        after = run_onnx(self.model, self.feeds, optimize=False)[0]
        np.testing.assert_allclose(after, self.before, atol=ATOL)

    def assert_lowered_numbers(self) -> None:
        """The fused graph, lowered to standard ops, computes what the original did."""
        assert LowerAttentionPass(get_target("tensorrt"))(self.model).modified
        after = run_onnx(self.model, self.feeds, optimize=False)[0]
        np.testing.assert_allclose(after, self.before, atol=ATOL)


def producer_ops(value: ir.Value, depth: int) -> list[str]:
    """The op types on the chain of first inputs above ``value``, nearest first."""
    ops = []
    for _ in range(depth):
        node = value.producer()
        if node is None:
            break
        ops.append(node.op_type)
        value = node.inputs[0]
    return ops


def rule_reason(run: Run, rule_class, root: ir.Node, *args) -> str:
    """Why one layout rule, matched on its root node only, refuses it."""
    return diagnose(run.model, [rule_class.rule(*args)], root, depth=0)


# -- AttentionRule -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"axis": 3},
        {"scale_op": "Mul", "scale": 1 / D**0.5},
        {"scale": None},
        {"q_scale": 0.5, "k_scale": 0.25},
        {"extra": True},
        {"guard": 0.0},
    ],
    ids=["plain", "axis-3", "mul-scale", "no-scale", "prescaled", "extra-term", "nan-guard-0"],
)
def test_core_positive_control(kwargs):
    run = Run(core_graph(**kwargs))
    assert run.modified
    node = run.attention()
    assert node.attributes["num_heads"].value == node.attributes["kv_num_heads"].value == H
    assert node.inputs[1].name == "k"  # Transpose(Transpose(k)) cancelled
    run.assert_lowered_numbers()


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"extra": True, "q_scale": 0.5}, "an extra score term with Q or K pre-scaled"),
        ({"extra": True, "k_scale": 0.5}, "an extra score term with Q or K pre-scaled"),
        ({"axis": 2}, "softmax over axis 2, not the key axis"),
        ({"axis": -2}, "softmax over axis -2, not the key axis"),
        ({"q_scale": "input"}, "the score scale is not a constant scalar"),
        ({"k_scale": "input"}, "the score scale is not a constant scalar"),
        ({"scale": "input"}, "the score scale is not a constant scalar"),
        ({"scale": np.full((1, H, 1, 1), 3.0)}, "the score scale is not a constant scalar"),
        ({"q_shape": (B, "heads", T, D)}, "Q is not 4-D (B, heads, seq, d) with static heads"),
        ({"q_shape": None}, "Q is not 4-D (B, heads, seq, d) with static heads"),
        ({"kt_shape": None}, "Kᵀ is not 4-D (B, heads, seq, d) with static heads"),
        ({"v_dims": (H, S, D)}, "V is not 4-D (B, heads, seq, d) with static heads"),
        (
            {"v_dims": (B, 1, S, D)},
            "Q's head count 4 is not a positive multiple of K's and V's (4, 1)",
        ),
        ({"guard": 1.0}, "the softmax NaN guard does not write 0"),
    ],
    ids=[
        "extra-term-prescaled-q",
        "extra-term-prescaled-k",
        "softmax-axis-2",
        "softmax-axis-minus-2",
        "scale-c_q-input",
        "scale-c_k-input",
        "scale-c-input",
        "scale-c-per-head",
        "q-symbolic-heads",
        "q-unknown-shape",
        "kt-unknown-shape",
        "v-3d",
        "v-heads-differ-from-k",
        "nan-guard-1",
    ],
)
def test_core_rejection(kwargs, reason):
    run = Run(core_graph(**kwargs))
    assert not run.modified
    assert reason in run.miss_reason()
    run.assert_unchanged_numbers()


# -- BatchedHeadsAttentionRule (BLOOM) -------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{}, {"axis": 3}], ids=["plain", "axis-3"])
def test_batched_heads_positive_control(kwargs):
    run = Run(bloom_graph(**kwargs))
    assert run.modified
    node = run.attention()
    attrs = {k: v.value for k, v in node.attributes.items()}
    assert (attrs["num_heads"], attrs["kv_num_heads"], attrs["bias_kind"]) == (H, H, "additive")
    assert attrs["scale"] == pytest.approx(0.3)
    assert not run.nodes("Softmax")
    run.assert_lowered_numbers()


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"axis": 2}, "softmax is not over the key axis"),
        ({"axis": 1}, "softmax is not over the key axis"),
        ({"scale": "input"}, "the score scale is not a constant scalar"),
        ({"scale": np.full((1, T, 1), 0.3)}, "the score scale is not a constant scalar"),
        ({"q3_shape": None}, "Q, Kᵀ, V are not 3-D (batch·heads, seq, d)"),
        ({"kt3_dims": (D, S)}, "Q, Kᵀ, V are not 3-D (batch·heads, seq, d)"),
        ({"v3_dims": (S, D)}, "Q, Kᵀ, V are not 3-D (batch·heads, seq, d)"),
        ({"scores4_shape": (B, "heads", T, S)}, "the 4-D views have no static head count"),
        ({"scores4_shape": None}, "the 4-D views have no static head count"),
        ({"y4_shape": (B, "heads", T, D)}, "the 4-D views have no static head count"),
        ({"y4_shape": None}, "the 4-D views have no static head count"),
    ],
    ids=[
        "softmax-axis-2",
        "softmax-axis-1",
        "scale-input",
        "scale-per-query",
        "q3-unknown-shape",
        "kt3-2d",
        "v3-2d",
        "scores4-symbolic-heads",
        "scores4-unknown-shape",
        "y4-symbolic-heads",
        "y4-unknown-shape",
    ],
)
def test_batched_heads_rejection(kwargs, reason):
    run = Run(bloom_graph(**kwargs))
    assert not run.modified
    assert reason in run.miss_reason()
    run.assert_unchanged_numbers()


# -- DoubleTransposeRule ---------------------------------------------------------------------


def test_double_transpose_positive_control():
    run = Run(transposed_key_graph())
    assert run.modified
    node = run.attention()
    assert producer_ops(node.inputs[1], 3) == ["Transpose"]  # only the (B, S, H, d) one
    assert len(run.nodes("Transpose")) == 1
    run.assert_lowered_numbers()


@pytest.mark.parametrize(
    "built",
    [transposed_key_graph_noncancelling, lambda: transposed_key_graph(perm=None)],
    ids=["perms-compose-to-0213", "inner-perm-default"],
)
def test_double_transpose_rejection(built):
    run = Run(built())
    assert run.modified  # the core fuses; its K keeps both transposes
    node = run.attention()
    assert producer_ops(node.inputs[1], 3) == ["Transpose", "Transpose"]
    assert node.attributes["kv_num_heads"].value == node.attributes["num_heads"].value == H
    outer = node.inputs[1].producer()
    reason = rule_reason(run, attention_rules.DoubleTransposeRule, outer)
    assert "the transposes do not cancel" in reason
    run.assert_lowered_numbers()


# -- SdpaKeyLayoutRule -----------------------------------------------------------------------


def test_sdpa_key_layout_positive_control():
    run = Run(sdpa_key_graph())
    assert run.modified
    node = run.attention()
    assert node.inputs[1].name == "k"
    assert not run.nodes("Transpose") and not run.nodes("Reshape")
    run.assert_lowered_numbers()


SDPA_REJECTIONS = {
    # k declared without a shape
    "k-unknown-shape": ({"k_shape": None}, "K's shape is unknown"),
    # heads already folded into the batch: k is (B·H, S, d), its first reshape a no-op
    "k-3d": ({"k_dims": (B * H, S, D)}, "K's shape is unknown"),
    # the second reshape views the (B·H, d, S) keys as one head (B, 1, d, H·S): not Kᵀ
    "keys-of-all-heads-on-one-axis": (
        {"kt": (B, 1, D, H * S), "v_dims": (B, 1, H * S, D)},
        "the reshapes do not transpose K",
    ),
    # the 3-D view of k declared without a shape: not provably (B·H, S, d)
    "flat-unknown-shape": ({"flat_shape": None}, "the reshapes do not transpose K"),
    # the reshape to Kᵀ ends in -1: its key length is a new symbol, not provably k's
    "unproven-key-length": (
        {
            "k_shape": (B, H, "seq", D),
            "flat": (B * H, -1, D),
            "flat_shape": (B * H, "seq", D),
            "kt": (B, H, D, -1),
            "kt_shape": (B, H, D, "kv_seq"),
            "v_shape": (B, H, "kv_seq", D),
        },
        "the reshapes do not transpose K",
    ),
}


@pytest.mark.parametrize(("kwargs", "reason"), SDPA_REJECTIONS.values(), ids=SDPA_REJECTIONS)
def test_sdpa_key_layout_rejection(kwargs, reason):
    run = Run(sdpa_key_graph(**kwargs))
    assert run.modified  # the core fuses; its K keeps SDPA's transpose through a 3-D view
    node = run.attention()
    assert producer_ops(node.inputs[1], 4) == ["Transpose", "Reshape", "Transpose", "Reshape"]
    outer = node.inputs[1].producer()
    assert reason in rule_reason(run, attention_rules.SdpaKeyLayoutRule, outer)
    run.assert_lowered_numbers()


def test_sdpa_key_layout_rejects_a_view_that_is_not_kt():
    # (B, H, S, d) → (B, H·S, d) → (B, d, H·S) → (B, H, d, S): Kᵀ's shape, scrambled keys
    run = Run(sdpa_key_graph(flat=(B, H * S, D)))
    assert run.modified  # the core fuses; its K keeps the (not a transpose) views
    node = run.attention()
    assert producer_ops(node.inputs[1], 4) == ["Transpose", "Reshape", "Transpose", "Reshape"]
    outer = node.inputs[1].producer()
    reason = rule_reason(run, attention_rules.SdpaKeyLayoutRule, outer)
    assert "the reshapes do not transpose K" in reason
    run.assert_lowered_numbers()


# -- RepeatKVRule ----------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_repeat_kv_positive_control(bias):
    run = Run(repeat_kv_graph(bias=bias))
    assert run.modified
    node = run.attention()
    assert (node.attributes["num_heads"].value, node.attributes["kv_num_heads"].value) == (
        HQ,
        HKV,
    )
    assert [x.name for x in node.inputs[1:3]] == ["k", "v"]
    assert not run.nodes("Expand") and not run.nodes("Reshape")
    run.assert_lowered_numbers()


REPEAT_KV_REJECTIONS = {
    # tile order: x[:, None].expand(B, g, Hkv, S, d): query head h uses KV head h % Hkv
    "k-tiled-on-axis-1": ({"k_axis": 1}, "KV heads are not repeated along a new axis 2"),
    "v-tiled-on-axis-1": ({"v_axis": 1}, "KV heads are not repeated along a new axis 2"),
    "k-expansion-unknown": ({"exp_shapes": {"k": None}}, "the KV expansion's shape is unknown"),
    "v-expansion-unknown": ({"exp_shapes": {"v": None}}, "the KV expansion's shape is unknown"),
    "k-unknown-shape": ({"k_shape": None}, "the KV expansion's shape is unknown"),
    "symbolic-repeat": (
        {"exp_shapes": {"k": (B, HKV, "groups", S, D)}},
        "the KV repeat count is not static",
    ),
    "symbolic-kv-heads": ({"k_shape": (B, "kv_heads", S, D)}, "the KV repeat count is not static"),
    # one KV head "repeated" once: 1 · 1 ≠ 4 query heads (MatMul broadcasts it: MQA)
    "heads-do-not-add-up": (
        {"kv_heads": 1, "repeat": 1},
        "repeated KV heads do not add up to the query heads",
    ),
}


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(
    ("kwargs", "reason"), REPEAT_KV_REJECTIONS.values(), ids=REPEAT_KV_REJECTIONS
)
def test_repeat_kv_rejection(kwargs, reason, bias):
    run = Run(repeat_kv_graph(bias=bias, **kwargs))
    assert run.modified  # the core fuses; K and V keep their expansion
    node = run.attention()
    heads = kwargs.get("kv_heads", HKV) * kwargs.get("repeat", G)  # the expanded K/V's
    assert node.attributes["num_heads"].value == HQ
    assert node.attributes["kv_num_heads"].value == node.inputs[1].shape[1] == heads
    for value in node.inputs[1:3]:
        assert producer_ops(value, 3) == ["Reshape", "Expand", "Unsqueeze"]
    assert len(run.nodes("Expand")) == 2
    assert reason in rule_reason(run, attention_rules.RepeatKVRule, node)
    run.assert_lowered_numbers()


def regrouped_repeat_kv_graph():
    """K repeated along a new axis 2 (g · Hkv = Hq heads), then reshaped to (B, Hq, S·d/4, 4):
    the reshape regroups sequence and head size, which Q (head size 4) is built for."""
    g = Graph()
    seq, size = S * D // 4, 4
    q = g.input("q", (B, HQ, T, size))

    def repeat_kv(name, s, d, target):
        x = g.input(name, (B, HKV, s, d))
        x = g.op("Unsqueeze", x, g.ints([2]), shape=(B, HKV, 1, s, d))
        x = g.op("Expand", x, g.ints([1, 1, G, 1, 1]), shape=(B, HKV, G, s, d))
        return g.op("Reshape", x, g.ints(target), shape=target)

    k = repeat_kv("k", S, D, (B, HQ, seq, size))
    v = repeat_kv("v", seq, D, (B, HQ, seq, D))
    kt = g.op("Transpose", k, perm=[0, 1, 3, 2], shape=(B, HQ, size, seq))
    return g, _attention_on(g, q, kt, (B, HQ, size, seq), v), (B, HQ, T, D)


def test_repeat_kv_rejects_a_reshape_that_regroups_sequence_and_head_size():
    run = Run(regrouped_repeat_kv_graph())
    assert run.modified  # the core fuses; K and V keep their expansion
    node = run.attention()
    assert node.attributes["kv_num_heads"].value == HQ  # expansion kept
    for value in node.inputs[1:3]:
        assert producer_ops(value, 3) == ["Reshape", "Expand", "Unsqueeze"]
    reason = rule_reason(run, attention_rules.RepeatKVRule, node)
    assert "the KV reshape does not merge the repeat into the heads" in reason
    run.assert_lowered_numbers()


# -- AttentionRule: Q heads broadcast over K/V heads ------------------------------------------


def test_core_query_head_broadcast_over_key_heads():
    # one Q head that MatMul broadcasts over H K/V heads: not Attention(num_heads=1, kv=H)
    run = Run(core_graph(q_dims=(B, 1, T, D)))
    assert not run.modified
    assert (
        f"Q's head count 1 is not a positive multiple of K's and V's ({H}, {H})"
        in run.miss_reason()
    )
    run.assert_unchanged_numbers()


# -- BatchedScoresAttentionRule (GPT-NeoX-Japanese) ------------------------------------------


def batched_scores_graph(
    *,
    axis: int = -1,
    scale=0.25,
    q3_shape: tuple | None | str = "same",
    scores4_dims: tuple = (B, H, T, S),
    scores4_shape: tuple | None | str = "same",
    v_dims: tuple = (B, H, S, D),
    v_shape: tuple | None | str = "same",
):
    """Only the scores batched over heads, the probabilities times a 4-D V:
    ``MatMul(Softmax(Reshape(Mul(MatMul(q3, kᵀ3), c), (B, H, T, S)) + mask), V)``."""
    g = Graph()
    q3 = g.input("q3", (B * H, T, D), q3_shape)
    kt3 = g.input("kt3", (B * H, D, S))
    v, mask = g.input("v", v_dims, v_shape), g.input("mask", (B, 1, scores4_dims[2], S))
    s = g.op("MatMul", q3, kt3, shape=(B * H, T, S))
    s = g.op("Mul", s, g.factor(scale, "c"), shape=(B * H, T, S))
    declared = scores4_dims if scores4_shape == "same" else scores4_shape
    s = g.op("Reshape", s, g.ints(list(scores4_dims)), shape=declared)
    s = g.op("Add", s, mask, shape=scores4_dims)
    p = g.op("Softmax", s, axis=axis, shape=scores4_dims)
    return g, g.op("MatMul", p, v, shape=None), (B, *scores4_dims[1:3], D)


@pytest.mark.parametrize("kwargs", [{}, {"axis": 3}], ids=["plain", "axis-3"])
def test_batched_scores_positive_control(kwargs):
    run = Run(batched_scores_graph(**kwargs))
    assert run.modified
    node = run.attention()
    attrs = {k: v.value for k, v in node.attributes.items()}
    assert (attrs["num_heads"], attrs["kv_num_heads"], attrs["bias_kind"]) == (H, H, "additive")
    assert attrs["scale"] == pytest.approx(0.25)
    assert node.inputs[2].name == "v"  # V taken as it is
    run.assert_lowered_numbers()


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"axis": 2}, "softmax is not over the key axis"),
        ({"scale": "input"}, "the score scale is not a constant scalar"),
        ({"q3_shape": None}, "Q, Kᵀ are not 3-D (batch·heads, seq, d)"),
        ({"scores4_shape": (B, "heads", T, S)}, "the scores' view or V has no static head count"),
        ({"v_shape": (B, "heads", S, D)}, "the scores' view or V has no static head count"),
        ({"scores4_dims": (B, 2, 2 * T, S), "v_dims": (B, 2, S, D)},
         "the scores' view is not the split of (B·H)"),
        ({"v_dims": (B, 1, S, D)}, "the scores' view and V have different head counts"),
    ],
    ids=[
        "softmax-axis-2", "scale-input", "q3-unknown-shape", "scores4-symbolic-heads",
        "v-symbolic-heads", "view-regroups-queries", "v-heads-differ",
    ],
)  # fmt: skip
def test_batched_scores_rejection(kwargs, reason):
    run = Run(batched_scores_graph(**kwargs))
    assert not run.modified
    assert reason in run.miss_reason()
    run.assert_unchanged_numbers()


# -- StackedBiasRule (MPNet) -----------------------------------------------------------------


def stacked_bias_graph(*, inner_first: bool = True, outer_first: bool = True, shaw: bool = False):
    """``MatMul(Softmax(Add(Add(Q·Kᵀ/√d, b1), b2)), V)`` in the operand orders asked for;
    ``shaw``: b1 is an activation-dependent ``Q·Rᵀ`` instead of a bias."""
    g = Graph()
    q, k, v = g.input("q", (B, H, T, D)), g.input("k", (B, H, S, D)), g.input("v", (B, H, S, D))
    kt = g.op("Transpose", k, perm=[0, 1, 3, 2], shape=(B, H, D, S))
    s = g.op("MatMul", q, kt, shape=(B, H, T, S))
    s = g.op("Div", s, g.const(D**0.5), shape=(B, H, T, S))
    if shaw:
        rt = g.input("rt", (B, H, D, S))
        b1 = g.op("MatMul", q, rt, shape=(B, H, T, S))
    else:
        b1 = g.input("b1", (1, H, T, S))
    b2 = g.input("b2", (B, 1, T, S))
    s = g.op("Add", *((s, b1) if inner_first else (b1, s)), shape=(B, H, T, S))
    s = g.op("Add", *((s, b2) if outer_first else (b2, s)), shape=(B, H, T, S))
    p = g.op("Softmax", s, axis=-1, shape=(B, H, T, S))
    return g, g.op("MatMul", p, v, shape=None), (B, H, T, D)


@pytest.mark.parametrize("inner_first", [True, False])
@pytest.mark.parametrize("outer_first", [True, False])
def test_stacked_bias_positive_control(inner_first, outer_first):
    run = Run(stacked_bias_graph(inner_first=inner_first, outer_first=outer_first))
    assert run.modified
    node = run.attention()
    assert node.attributes["bias_kind"].value == "additive"
    assert producer_ops(node.inputs[3], 1) == ["Add"]  # b1 + b2, one bias
    run.assert_lowered_numbers()


def test_stacked_bias_rejects_a_bias_computed_from_the_scores():
    """Rejection: ``b1 = Q·Rᵀ`` is a score term, not a bias: the two Adds stay as they are
    (and the unscaled-extra form the core rule takes does not apply after the scale)."""
    run = Run(stacked_bias_graph(shaw=True))
    assert not run.modified
    from tfgraph.passes.recognize.attention.rules import BIAS_RULES

    (softmax,) = run.nodes("Softmax")
    reason = diagnose(run.model, BIAS_RULES, softmax, depth=0)
    assert "a bias is computed from the scores as well" in reason
    run.assert_unchanged_numbers()


def test_same_dims_compares_symbolic_expressions():
    """torch.export names a ``view(..., -1)`` key dim ``((sequence**2)//sequence)``: equal to
    ``sequence`` for every positive value, so the batched-scores view is a split of (B·H)."""
    from tfgraph.passes.rewrite_utils import same_dims

    seq = ir.SymbolicDim("sequence")
    assert same_dims([seq, 4], [ir.SymbolicDim("((sequence**2)//sequence)"), 4])
    assert same_dims([ir.SymbolicDim("4*batch")], [ir.SymbolicDim("batch*4")])
    assert not same_dims([seq], [ir.SymbolicDim("sequence + 1")])
    assert not same_dims([seq], [ir.SymbolicDim("past")])
    assert not same_dims([seq], [ir.SymbolicDim(None)])  # unknown is never equal
    assert not same_dims([seq, 4], [seq])
    assert not same_dims([4], [5])
