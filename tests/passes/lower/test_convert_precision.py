"""``ConvertPrecisionPass`` and the fp16 emulation the island measurement runs, on tiny graphs.

Types, Casts at island edges, clipping of mask sentinels, ``keep_io_types``, the ``modified``
flag; then numbers: the converted graph in ONNX Runtime against the fp32 graph, and the
emulation showing the rounding that ONNX Runtime's CPU provider hides.
"""

import collections

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common
import pytest
from ort_run import ort_session

from tfgraph.passes.lower.convert_precision import ConvertPrecisionPass
from tfgraph.precision.islands import emulate

F16, F32 = ir.DataType.FLOAT16, ir.DataType.FLOAT

TEXT = """
<ir_version: 10, opset_import: ["" : 20]>
g (float[2, 4] x, int64[2] ids) => (float[2, 4] y, int64[2] ids_out) <float[4, 4] w = {WEIGHTS}> {
    h = MatMul(x, w)
    lowest = Constant<value = float {-3.4e38}>()
    masked = Max(h, lowest)
    soft = Softmax<axis = -1>(masked)
    big = Constant<value = float {3000}>()
    shifted = Add(soft, big)
    y = Sub(shifted, big)
    ids_out = Identity(ids)
}
""".replace("WEIGHTS", ", ".join(str(float(v)) for v in np.linspace(-1, 1, 16)))


def _model() -> ir.Model:
    """The graph above, each node named after its first output (islands are node names)."""
    model = ir.from_onnx_text(TEXT)
    common.ShapeInferencePass()(model)  # the pipeline's graphs carry their types
    for node in model.graph:
        node.name = f"n_{node.outputs[0].name}"
    return model


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto)
    session = ort_session(proto, optimize=False)
    typed = x.astype(np.float16) if session.get_inputs()[0].type == "tensor(float16)" else x
    return session.run(None, {"x": typed, "ids": np.array([1, 2], np.int64)})[0]


X = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)


def test_everything_fp16_without_islands():
    model = _model()
    result = ConvertPrecisionPass(F16)(model)
    assert result.modified
    graph = model.graph
    assert graph.inputs[0].dtype == F16 and graph.outputs[0].dtype == F16
    assert graph.inputs[1].dtype == ir.DataType.INT64  # integers are never touched
    assert graph.initializers["w"].const_value.numpy().dtype == np.float16
    lowest = next(n for n in graph if n.outputs[0].name == "lowest")
    # finfo(float32).min becomes fp16's lowest finite value, not -inf
    assert lowest.attributes.get_tensor("value").numpy() == np.float16(-65504)
    assert not any(n.op_type == "Cast" for n in graph)
    out = _run(model, X)
    assert out.dtype == np.float16 and np.isfinite(out).all()


def test_islands_get_casts_on_their_edges_only():
    model = _model()
    ConvertPrecisionPass(F16, keep=frozenset({"n_shifted", "n_y"}))(model)
    names = _names(model)
    assert names["n_shifted"].outputs[0].dtype == F32  # the island computes in fp32
    casts = [n for n in model.graph if n.op_type == "Cast"]
    # into the island: soft (fp16 → fp32); big is read by the island only and stays fp32;
    # out of it: y (fp32 → fp16) at the graph's edge
    targets = collections.Counter(ir.DataType(n.attributes.get_int("to")) for n in casts)
    assert targets == {F32: 1, F16: 1}, casts
    assert model.graph.outputs[0].dtype == F16 and model.graph.outputs[0].name == "y"
    np.testing.assert_allclose(_run(model, X).astype(np.float32), _run(_model(), X), atol=2e-3)


def _names(model: ir.Model) -> dict:
    return {n.name: n for n in model.graph}


def test_keep_io_types_casts_at_the_edges():
    model = _model()
    ConvertPrecisionPass(F16, keep_io_types=True)(model)
    assert model.graph.inputs[0].dtype == F32 and model.graph.outputs[0].dtype == F32
    assert model.graph.outputs[0].name == "y"
    out = _run(model, X)
    assert out.dtype == np.float32


def test_nothing_to_convert_is_not_modified():
    model = ir.from_onnx_text(
        """
        <ir_version: 10, opset_import: ["" : 20]>
        g (int64[2] a) => (int64[2] b) { b = Add(a, a) }
        """
    )
    assert not ConvertPrecisionPass(F16)(model).modified


def test_bf16_is_the_other_low_type():
    model = _model()
    ConvertPrecisionPass(ir.DataType.BFLOAT16)(model)
    assert model.graph.inputs[0].dtype == ir.DataType.BFLOAT16
    onnx.checker.check_model(ir.serde.serialize_model(model))
    with pytest.raises(ValueError):
        ConvertPrecisionPass(ir.DataType.DOUBLE)


def test_emulation_rounds_between_nodes_where_the_cpu_provider_does_not():
    # (soft + 3000) − 3000 in fp16 keeps 2 units of spacing: almost nothing of soft survives
    fp32 = _run(_model(), X)
    converted = _model()
    ConvertPrecisionPass(F16)(converted)
    on_cpu = _run(converted, X).astype(np.float32)
    emulated = _run(emulate(_model(), F16, frozenset()), X)
    assert np.abs(on_cpu - fp32).max() < 2e-3  # ORT fused the Add/Sub Casts away: exact
    assert np.abs(emulated - fp32).max() > 0.1  # the device stores 3000 + soft in fp16
    island = emulate(_model(), F16, frozenset({"n_shifted", "n_y"}))
    assert np.abs(_run(island, X) - fp32).max() < 2e-3
