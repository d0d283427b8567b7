"""A standard ONNX ``Attention`` (SDPA exported at opset ≥ 23) recognized and re-lowered.

Each positive graph is one hand-built ``Attention`` node; the ``default`` pipeline must turn it
into the target's kernel (``ort``: GroupQueryAttention / MultiHeadAttention; ``onnx``:
``Attention``-23 again; ``tensorrt``: standard ops only) and compute what the original computes
in ONNX Runtime. Each negative graph turns one knob of a positive one so that exactly one
``check`` of :mod:`tfgraph.passes.recognize.attention.onnx_attention` rejects it: the node
stays, reported as missed with that reason. Every graph goes through the pass twice; the
second run finds nothing to do.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from ort_run import run_onnx

import tfgraph
from tfgraph.exporters.compile import count_fusions, run_pipeline
from tfgraph.passes.pipeline.fusions import op_histogram
from tfgraph.passes.recognize.attention.fuse import FuseAttentionPass
from tfgraph.passes.rewrite_utils import MISS_REASON_KEY

B, D = 2, 16
ATOL = 1e-5
SCOPES = ["", "l0", "l0.attn", "scaled_dot_product_attention"]  # the last one: the op
GQA, MHA = "com.microsoft::GroupQueryAttention", "com.microsoft::MultiHeadAttention"


@dataclass(frozen=True)
class Case:
    hq: int = 4
    hkv: int = 4
    t: int = 6
    s: int = 6
    causal: int = 0
    mask: str = "none"  # none, float, bool
    mask_dims: str = "b1ts"  # b1ts: (B, 1, T, S); ts: (T, S)
    scale: float | None = None  # None: the spec's default 1/√d
    rank: int = 4  # 3: (B, L, H·d) with q_num_heads / kv_num_heads
    opset: int = 23
    ort_op: str = GQA
    dv: int = D  # V's head size: narrower than Q/K's in multi-head latent attention (DeepSeek)


CASES = {
    "causal": Case(causal=1),
    "causal_top_left_s_gt_t": Case(t=4, s=7, causal=1, ort_op=MHA),
    "bidirectional": Case(ort_op=MHA),
    "float_mask": Case(mask="float"),
    "float_mask_causal": Case(causal=1, mask="float"),
    "bool_mask": Case(mask="bool"),
    "bool_mask_2d_causal": Case(causal=1, mask="bool", mask_dims="ts"),
    "gqa_causal": Case(hq=8, hkv=2, causal=1),
    "mqa_cross": Case(hq=8, hkv=1, t=4, s=7, ort_op=MHA),
    "explicit_scale": Case(causal=1, scale=0.3),
    "3d_gqa_causal": Case(hq=8, hkv=2, causal=1, rank=3),
    "3d_bool_mask_scale": Case(mask="bool", scale=0.3, rank=3),
    "opset24_float_mask": Case(causal=1, mask="float", opset=24),
    "mla_narrower_v_causal": Case(causal=1, dv=8, ort_op=MHA),
}


def _shape(case: Case, heads: int, length: int, d: int = D) -> tuple:
    return (B, heads, length, d) if case.rank == 4 else (B, length, heads * d)


def build(case: Case, seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Graph inputs Q, K, V (and ``attn_mask``) → ``Attention`` → Y, and feeds for them."""
    rng = np.random.default_rng(seed)
    shapes = {
        "Q": _shape(case, case.hq, case.t),
        "K": _shape(case, case.hkv, case.s),
        "V": _shape(case, case.hkv, case.s, case.dv),
    }
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()]
    if case.mask != "none":
        dims = (B, 1, case.t, case.s) if case.mask_dims == "b1ts" else (case.t, case.s)
        visible = rng.random(dims) > 0.3
        visible[..., 0] = True  # no fully masked row
        if case.mask == "bool":
            feeds["attn_mask"], elem = visible, TensorProto.BOOL
        else:
            values = rng.standard_normal(dims) + np.where(visible, 0.0, -1e9)
            feeds["attn_mask"], elem = values.astype(np.float32), TensorProto.FLOAT
        inputs.append(helper.make_tensor_value_info("attn_mask", elem, dims))
    attrs = {"is_causal": case.causal}
    if case.scale is not None:
        attrs["scale"] = case.scale
    if case.rank == 3:
        attrs.update(q_num_heads=case.hq, kv_num_heads=case.hkv)
    names = [i.name for i in inputs]
    node = helper.make_node("Attention", names, ["Y"], name="attn", **attrs)
    node.metadata_props.add(key="pkg.torch.onnx.name_scopes", value=str(SCOPES))
    y = helper.make_tensor_value_info(
        "Y", TensorProto.FLOAT, _shape(case, case.hq, case.t, case.dv)
    )
    graph = helper.make_graph([node], "attention", inputs, [y])
    opsets = [helper.make_opsetid("", case.opset)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10), feeds


def run_ort(model: onnx.ModelProto | ir.Model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return run_onnx(model, feeds, optimize=False)[0]


def fuse(proto: onnx.ModelProto) -> tuple[ir.Model, bool]:
    """The pass, twice (the graph inputs declare every shape); whether the first run fused."""
    model = ir.from_proto(proto)
    modified = FuseAttentionPass()(model).modified
    assert not FuseAttentionPass()(model).modified  # a second run finds nothing to do
    return model, modified


@pytest.mark.parametrize("target", ["ort", "onnx", "tensorrt"])
@pytest.mark.parametrize("name", list(CASES))
def test_default_pipeline_relowers_attention(name: str, target: str) -> None:
    case = CASES[name]
    proto, feeds = build(case)
    model = ir.from_proto(proto)
    run_pipeline(model, "default", target=target, check_each_pass=True)
    ops = op_histogram(model)
    if target == "ort":
        assert ops[case.ort_op] == 1 and "Attention" not in ops, ops
    elif target == "onnx":
        assert ops["Attention"] == 1 and not any("::" in op for op in ops), ops
    else:
        assert not any("Attention" in op or "::" in op for op in ops), ops
    attention = count_fusions(model)["attention"]
    assert attention["fused"] == attention["total"] == 1, attention["missed"]
    assert attention["fused_layers"][0]["module"] == "l0.attn"
    np.testing.assert_allclose(run_ort(model, feeds), run_ort(proto, feeds), atol=ATOL)


def _canonical(model: ir.Model) -> dict:
    (node,) = [n for n in model.graph if n.domain == "tfgraph"]
    return {k: a.value for k, a in node.attributes.items()} | {"inputs": len(node.inputs)}


@pytest.mark.parametrize("name", list(CASES))
def test_canonical_attributes(name: str) -> None:
    case = CASES[name]
    model, modified = fuse(build(case)[0])
    assert modified
    attrs = _canonical(model)
    assert (attrs["num_heads"], attrs["kv_num_heads"]) == (case.hq, case.hkv)
    assert attrs["scale"] == pytest.approx(case.scale or D**-0.5)
    assert attrs["causal"] == case.causal
    assert attrs["causal_alignment"] == ("top_left" if case.causal else "bottom_right")
    assert attrs["inputs"] == (3 if case.mask == "none" else 4)
    assert not any(n.op_type == "Attention" and n.domain == "" for n in model.graph)


# ---- rejections: one knob of a positive graph each ------------------------------------------


def _add_input(proto: onnx.ModelProto, name: str, elem: int, dims: tuple) -> None:
    proto.graph.input.append(helper.make_tensor_value_info(name, elem, dims))


def _set_input(index: int, name: str, elem: int, dims: tuple):
    def tweak(proto: onnx.ModelProto) -> None:
        node = proto.graph.node[0]
        while len(node.input) <= index:
            node.input.append("")
        node.input[index] = name
        _add_input(proto, name, elem, dims)

    return tweak


def _set_attr(**attrs):
    def tweak(proto: onnx.ModelProto) -> None:
        node = proto.graph.node[0]
        kept = [a for a in node.attribute if a.name not in attrs]
        del node.attribute[:]
        node.attribute.extend(kept + [helper.make_attribute(k, v) for k, v in attrs.items()])

    return tweak


def _set_dims(name: str, dims):
    def tweak(proto: onnx.ModelProto) -> None:
        value = next(i for i in proto.graph.input if i.name == name)
        value.CopyFrom(helper.make_tensor_value_info(name, value.type.tensor_type.elem_type, dims))

    return tweak


def _present_output(proto: onnx.ModelProto) -> None:
    proto.graph.node[0].output.append("present_key")
    proto.graph.output.append(helper.make_tensor_value_info("present_key", TensorProto.FLOAT, None))


def _past(proto: onnx.ModelProto) -> None:
    for index, name in ((4, "past_key"), (5, "past_value")):
        _set_input(index, name, TensorProto.FLOAT, (B, 4, 3, D))(proto)


def _at_opset(opset: int):
    def tweak(proto: onnx.ModelProto) -> None:
        proto.opset_import[0].version = opset

    return tweak


FLOAT, BOOL, INT64 = TensorProto.FLOAT, TensorProto.BOOL, TensorProto.INT64
REJECTIONS = {  # name: (base case, tweak, reason fragment)
    "opset_25": (Case(), _at_opset(25), "only opsets 23 and 24"),
    "past": (Case(), _past, "past_key/past_value given"),
    "nonpad_kv_seqlen": (
        Case(opset=24),
        _set_input(6, "nonpad", INT64, (B,)),
        "nonpad_kv_seqlen given",
    ),
    "present_output_used": (Case(), _present_output, "present_key/present_value"),
    "softcap": (Case(), _set_attr(softcap=30.0), "softcap is not 0"),
    "softmax_precision": (
        Case(),
        _set_attr(softmax_precision=TensorProto.DOUBLE),
        "softmax_precision differs",
    ),
    "rank_unknown": (Case(), _set_dims("Q", None), "not all 4-D or all 3-D"),
    "mixed_ranks": (Case(), _set_dims("Q", (B, 6, 4 * D)), "not all 4-D or all 3-D"),
    "symbolic_heads": (Case(), _set_dims("Q", (B, "h", 6, D)), "head counts not static"),
    "heads_do_not_divide": (
        Case(hq=6, hkv=4),
        lambda proto: None,
        "KV heads do not divide Q heads",
    ),
    "3d_without_head_counts": (Case(rank=3), _set_attr(q_num_heads=0), "head counts not static"),
    "v_head_size_symbolic": (
        Case(),
        _set_dims("V", (B, 4, 6, "dv")),
        "V's head size is neither provably Q's nor static",
    ),
    "no_scale_symbolic_head_size": (
        Case(),
        lambda proto: [_set_dims(n, (B, 4, 6, "d"))(proto) for n in ("Q", "K", "V")],
        "no scale attribute and no static head size",
    ),
    "mask_shape_unknown": (Case(mask="float"), _set_dims("attn_mask", None), "shape is unknown"),
    "mask_key_axis_short": (
        Case(mask="float"),
        _set_dims("attn_mask", (B, 1, 6, 4)),
        "key axis is not provably S",
    ),
    "mask_type": (
        Case(),
        _set_input(3, "int_mask", INT64, (B, 1, 6, 6)),
        "neither bool nor of the inputs' known type",
    ),
}


@pytest.mark.parametrize("name", list(REJECTIONS))
def test_rejection_is_reported(name: str) -> None:
    case, tweak, reason = REJECTIONS[name]
    proto = build(case)[0]
    tweak(proto)
    model, modified = fuse(proto)
    assert not modified
    (node,) = [n for n in model.graph if n.op_type == "Attention"]
    assert node.domain == "" and reason in node.metadata_props[MISS_REASON_KEY]
    attention = count_fusions(model)["attention"]
    assert (attention["fused"], attention["total"]) == (0, 1)
    assert reason in attention["missed"][0]["reason"]
    assert attention["missed"][0]["module"] == "l0.attn"


def test_rejected_node_survives_the_default_pipeline() -> None:
    """Left as exported, counted as missed (not fused), and still computing the same."""
    proto, feeds = build(Case(causal=1))
    _set_attr(softcap=30.0)(proto)
    model = ir.from_proto(proto)
    run_pipeline(model, "default", target="ort", check_each_pass=True)
    assert Counter(n.op_type for n in model.graph) == Counter({"Attention": 1})
    attention = count_fusions(model)["attention"]
    assert (attention["fused"], attention["total"]) == (0, 1)
    np.testing.assert_allclose(run_ort(model, feeds), run_ort(proto, feeds), atol=ATOL)


def test_untouched_pipeline_counts_exported_attention_as_fused() -> None:
    """Without the recognition pass, the exported ``Attention`` is a fused kernel as is."""
    model = ir.from_proto(build(CASES["causal"])[0])
    run_pipeline(model, "cleanup")
    attention = count_fusions(model, "cleanup")["attention"]
    assert attention["fused"] == attention["total"] == 1


def test_export_sdpa_preset_at_opset_23_for_ort(tmp_path) -> None:
    """End to end: SDPA traced at opset 23 is one ``Attention`` per layer; the ``ort`` target
    gets its contrib kernels for every one (GQA 8:2, repeat_kv absorbed), and parity holds."""
    out = tmp_path / "llama-sdpa"
    result = tfgraph.export("llama-tiny-sdpa", out, target="ort", opset=23)
    assert result.passed, result.report["parity"]["outputs"]
    attention = result.report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == 2, attention["missed"]
    ops = op_histogram(ir.load(out / "model.onnx"))
    assert "Attention" not in ops and ops[GQA] == 2, ops
