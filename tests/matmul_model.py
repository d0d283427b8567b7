"""The one-``MatMul`` ONNX model the weight-quantization tests hand to ONNX Runtime's own
quantizers (``y = x @ w``, ``x`` of shape ``(m, K)``), to compare their bytes with ours."""

from __future__ import annotations

import numpy as np
import onnx


def matmul_proto(w: np.ndarray, opset: int = 20) -> onnx.ModelProto:
    """``y = x @ w`` with ``w`` (K, N) an initializer and the node named ``mm``."""
    k, n = w.shape
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["m", k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["m", n])],
        [onnx.numpy_helper.from_array(w, "w")],
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
