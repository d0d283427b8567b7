"""``--method rtn|hqq|k_quant|gptq``: each method's bytes are what ONNX Runtime's kernel
computes with (read back exactly by the eager reference's dequantization), what ONNX Runtime's
own whole-model path gives where it has one, and an export by each passes its parity rule."""

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from matmul_model import matmul_proto
from ort_run import ort_session

import tfgraph
from tfgraph.errors import TfgraphError
from tfgraph.exporters.ort.weights.dequantize import dequantize, dequantize_parts
from tfgraph.exporters.ort.weights.methods import node_quantizer
from tfgraph.exporters.ort.weights.packing import pack
from tfgraph.exporters.targets import get_target


def _matmul_proto(w: np.ndarray) -> onnx.ModelProto:
    return matmul_proto(w, opset=21)


def _nbits_proto(parts, k, n, bits, block, level) -> onnx.ModelProto:
    names = ["B", "S", "Z"][: 2 + (parts[2] is not None)]
    inits = [onnx.numpy_helper.from_array(p, nm) for p, nm in zip(parts, names, strict=False)]
    node = onnx.helper.make_node(
        "MatMulNBits", ["x", *names], ["y"], domain="com.microsoft",
        K=k, N=n, bits=bits, block_size=block, accuracy_level=level,
    )  # fmt: skip
    graph = onnx.helper.make_graph(
        [node],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["m", k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["m", n])],
        inits,
    )
    opsets = [onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid("com.microsoft", 1)]
    return onnx.helper.make_model(graph, opset_imports=opsets)


def _hessian(k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((300, k)) * rng.uniform(0.1, 3.0, k)  # uneven input energy
    return 2 * x.T @ x / len(x)


@pytest.mark.parametrize(
    "method, bits, symmetric",
    [
        ("rtn", 4, True),
        ("k_quant", 4, False),
        ("k_quant", 8, False),
        ("hqq", 4, False),
        ("gptq", 4, True),
        ("gptq", 4, False),
    ],
)
def test_bytes_are_what_the_kernel_computes_with(method, bits, symmetric):
    """ORT's kernel on I gives the weight it computes with: our dequantization of the method's
    bytes equals it (K = 80: the last of 3 blocks padded, an odd number of zero points)."""
    k, n, block = 80, 24, 32
    w = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32)
    spec = node_quantizer(method, bits, block, symmetric, 0, hessian=lambda: _hessian(k))
    parts = spec.quantize(np.ascontiguousarray(w.T))
    assert (parts[2] is None) == (spec.zero_points is None)
    ours = dequantize_parts(*parts, bits, block, k).T
    session = ort_session(_nbits_proto(parts, k, n, bits, block, 0))
    kernel = session.run(None, {"x": np.eye(k, dtype=np.float32)})[0]
    np.testing.assert_allclose(ours, kernel, rtol=0, atol=1e-6)
    assert 1e-4 < np.abs(ours - w).max() < 0.5 * np.abs(w).max()  # quantized, not garbage


def test_hqq_float_zero_points_run_at_level_0_whatever_level_4_says():
    """The CPU kernel computes float zero points with fp32 activations at level 4 too (so HQQ
    nodes are written at level 0): level 4's result equals level 0's, unlike uint8 ones."""
    k, n, block = 64, 16, 32
    w = np.random.default_rng(2).standard_normal((k, n)).astype(np.float32)
    x = np.random.default_rng(3).standard_normal((4, k)).astype(np.float32)
    spec = node_quantizer("hqq", 4, block, False, 4)
    assert spec.accuracy_level == 0
    parts = spec.quantize(np.ascontiguousarray(w.T))
    assert parts[2].dtype == np.float32
    y0, y4 = (
        ort_session(_nbits_proto(parts, k, n, 4, block, lv)).run(None, {"x": x})[0] for lv in (0, 4)
    )
    np.testing.assert_allclose(y4, y0, rtol=0, atol=1e-4)
    rtn = node_quantizer("rtn", 4, block, False, 4).quantize(np.ascontiguousarray(w.T))
    r0, r4 = (
        ort_session(_nbits_proto(rtn, k, n, 4, block, lv)).run(None, {"x": x})[0] for lv in (0, 4)
    )
    assert np.abs(r4 - r0).max() > 1e-3  # uint8 zero points do take the int8 path


@pytest.mark.parametrize(
    "method, config",
    [("k_quant", "KQuantWeightOnlyQuantConfig"), ("hqq", "HQQWeightOnlyQuantConfig")],
)
def test_same_weight_as_onnx_runtimes_whole_model_path(method, config):
    """``MatMulNBitsQuantizer(model, algo_config=…)`` on a one-MatMul model and our per-tensor
    bytes dequantize to the same weight (K = 96: 3 blocks, whose zero points ONNX Runtime's
    k_quant packing runs across rows: compared on N = 1, where they cannot)."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    k, block = 96, 32
    for n in (1, 24) if method == "hqq" else (1,):
        w = np.random.default_rng(4).standard_normal((k, n)).astype(np.float32)
        cfg = (
            getattr(mnq, config)(block_size=block)
            if method == "hqq"
            else mnq.KQuantWeightOnlyQuantConfig()
        )
        quantizer = mnq.MatMulNBitsQuantizer(_matmul_proto(w), block_size=block, algo_config=cfg)
        quantizer.process()
        model = ir.serde.deserialize_model(quantizer.model.model)
        node = next(x for x in model.graph if x.op_type == "MatMulNBits")
        theirs = dequantize(node, model.graph.initializers, (k, n))
        parts = node_quantizer(method, 4, block, False, 0).quantize(np.ascontiguousarray(w.T))
        np.testing.assert_allclose(dequantize_parts(*parts, 4, block, k).T, theirs, atol=1e-6)


def test_float_zero_points_dequantize_the_same_by_rows():
    """The streamed reference's (N, K) dequantization reads HQQ's float zero points as
    :func:`dequantize` does (K = 80: a padded last block)."""
    from tfgraph.exporters.ort.weights.dequantize import dequantize_rows

    k, n, block = 80, 24, 32
    w = np.random.default_rng(6).standard_normal((k, n)).astype(np.float32)
    parts = node_quantizer("hqq", 4, block, False, 0).quantize(np.ascontiguousarray(w.T))
    model = ir.serde.deserialize_model(_nbits_proto(parts, k, n, 4, block, 0))
    node = next(iter(model.graph))
    want = dequantize(node, model.graph.initializers, (k, n))
    np.testing.assert_array_equal(dequantize_rows(node, model.graph.initializers).numpy(), want.T)
    np.testing.assert_allclose(want, dequantize_parts(*parts, 4, block, k).T, atol=1e-7)


def test_zero_points_are_packed_per_row():
    """3 blocks a row: each row's zero points take 2 bytes of their own (ORT's Python packing
    runs them across rows)."""
    q = np.zeros((2, 96), np.uint8)
    zp = np.array([[1, 2, 3], [4, 5, 6]])
    _, _, packed = pack(q, np.ones((2, 3), np.float32), zp, 4, 32)
    assert packed.shape == (2, 2)
    assert packed[:, 0].tolist() == [1 | 2 << 4, 4 | 5 << 4]
    assert (packed[:, 1] & 0x0F).tolist() == [3, 6]


def test_gptq_lowers_the_calibrated_error_below_rtn():
    """‖X(W−Q)‖ on inputs of uneven energy: asymmetric GPTQ (ONNX Runtime's, its error
    feedback repaired) below round to nearest; symmetric GPTQ below ONNX Runtime's unrepaired
    routine (round to nearest on GPTQ's ±7.5-step grid: its result is no better than that)."""
    from onnxruntime.quantization.neural_compressor.weight_only import gptq

    k, n, block = 128, 48, 32
    rng = np.random.default_rng(5)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((400, k)) * rng.uniform(0.1, 3.0, k)
    h = 2 * x.T @ x / len(x)

    def error(method, symmetric):
        spec = node_quantizer(method, 4, block, symmetric, 0, hessian=lambda: h)
        deq = dequantize_parts(*spec.quantize(np.ascontiguousarray(w.T)), 4, block, k).T
        return np.linalg.norm(x @ (w - deq))

    assert error("gptq", False) < 0.95 * error("rtn", False)
    unrepaired = gptq(w.copy(), h.copy(), 4, block, "sym")
    assert error("gptq", True) < 0.95 * np.linalg.norm(x @ (w - unrepaired))


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"weight_method": "hqq"}, "add --weights"),
        ({"weights": "int4", "weight_method": "gptq"}, "--calibration-text"),
        ({"weights": "mixed"}, "--calibration-text"),
        ({"weights": "int8", "weight_method": "gptq"}, "4 bits only"),
        ({"weights": "int8", "weight_method": "hqq"}, "float zero points"),
        ({"weights": "int4", "weight_method": "awq"}, "unknown --method"),
    ],
)
def test_refusals(fields, says):
    with pytest.raises(TfgraphError, match=says):
        tfgraph.ExportOptions(**fields).resolved(get_target("ort"))


# hqq's and k_quant's exports in the slow tier (~15 s each: the default tier's budget); their
# bytes are checked against the kernel and ORT's whole-model path above, hqq's float zero points
# through the streamed reference's dequantization below; gptq's (calibration) stays
@pytest.mark.parametrize(
    "method",
    [
        pytest.param("hqq", marks=pytest.mark.slow),
        pytest.param("k_quant", marks=pytest.mark.slow),
        "gptq",
    ],
)
def test_export_passes_parity(tmp_path, tiny_llama_dir, calibration_text, method):
    """An export of a tiny Llama by each method passes its parity rule (the reference is the
    dequantized artifact) and its report names the method."""
    out = tmp_path / method
    extra = {"calibration_text": str(calibration_text)} if method == "gptq" else {}
    result = tfgraph.export(
        str(tiny_llama_dir), out, weights="int4", weight_method=method, symmetric=False, **extra
    )
    assert result.passed
    weights = json.loads((out / "report.json").read_text())["weights"]
    assert weights["method"] == method
    assert weights["symmetric"] is False
    if method == "gptq":
        assert weights["calibration"]["tokens"] > 100
    model = onnx.load(out / "model.onnx", load_external_data=False)
    levels = {
        a.i
        for node in model.graph.node
        if node.op_type == "MatMulNBits"
        for a in node.attribute
        if a.name == "accuracy_level"
    }
    assert levels == (set() if method == "hqq" else {4})  # hqq's written at level 0


REFERENCE_MODEL = "bench/reference_model"


# slow: 12 exports of the 18.9 M-parameter reference model (~20-60 s each)
@pytest.mark.slow
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize(
    "method, symmetric",
    [
        ("rtn", True),
        ("rtn", False),
        ("hqq", False),
        ("k_quant", False),
        ("gptq", True),
        ("gptq", False),
    ],
)
def test_reference_model_exports_pass_parity(tmp_path, method, symmetric, block):
    """Every method x group x zero points on the trained model passes its parity rule; GPTQ
    calibrates on the model's training files (not its held-out text)."""
    from tfgraph.tools.train_reference import corpus_files, read_text

    extra = {}
    if method == "gptq":
        text = tmp_path / "calibration.txt"
        text.write_text(read_text(corpus_files()[0][::-1], 30_000))
        extra = {"calibration_text": str(text)}
    result = tfgraph.export(
        REFERENCE_MODEL,
        tmp_path / "a",
        weights="int4",
        weight_method=method,
        block_size=block,
        symmetric=symmetric,
        **extra,
    )
    assert result.passed
    assert result.report["weights"]["method"] == method
