"""GemmAsMatMul: plain Gemms with a constant weight become MatMul (+ Add), same numbers."""

import numpy as np
import onnx
import onnx_ir as ir
from ort_run import run_onnx

from tfgraph.passes.lower.gemm_as_matmul import gemm_as_matmul


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w_kn = rng.standard_normal((8, 6)).astype(np.float32)
    w_nk = rng.standard_normal((6, 8)).astype(np.float32)
    bias = rng.standard_normal(6).astype(np.float32)
    h = onnx.helper
    nodes = [
        h.make_node("Gemm", ["x", "w_kn"], ["a"], name="plain"),  # no C
        h.make_node("Gemm", ["x", "w_nk", "bias"], ["b"], name="trans_b", transB=1),
        h.make_node("Gemm", ["x", "w_kn"], ["c"], name="scaled", alpha=2.0),  # left alone
        h.make_node("Gemm", ["x", "y"], ["d"], name="dynamic"),  # B not constant: left alone
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [
            h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [5, 8]),
            h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [8, 6]),
        ],
        [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [5, 6]) for n in "abcd"],
        [
            onnx.numpy_helper.from_array(w_kn, "w_kn"),
            onnx.numpy_helper.from_array(w_nk, "w_nk"),
            onnx.numpy_helper.from_array(bias, "bias"),
        ],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 20)])


def _run(proto: onnx.ModelProto, feeds: dict) -> list:
    return run_onnx(proto, feeds)


def test_plain_gemms_become_matmuls_with_the_same_numbers():
    proto = _model()
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((5, 8)).astype(np.float32)}
    feeds["y"] = rng.standard_normal((8, 6)).astype(np.float32)
    want = _run(proto, feeds)
    model = ir.serde.deserialize_model(proto)
    assert gemm_as_matmul(model) == 2
    ops = [n.op_type for n in model.graph]
    assert ops.count("Gemm") == 2 and ops.count("MatMul") == 2 and ops.count("Add") == 1
    assert {n.name for n in model.graph if n.op_type == "Gemm"} == {"scaled", "dynamic"}
    got = _run(ir.serde.serialize_model(model), feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
