"""Per-MatMul quantization (:mod:`tfgraph.exporters.ort.weights.nbits`) gives the nodes, names
and bytes of ONNX Runtime's ``MatMulNBitsQuantizer`` run on the whole model, on zoo presets after
their pipeline, and materializes one weight at a time."""

import numpy as np
import onnx_ir as ir
import pytest
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from tfgraph.exporters.compile import run_pipeline
from tfgraph.exporters.ort.weights.nbits import quantize_matmuls
from tfgraph.sources import load_source
from tfgraph.sources.trace import trace


def _graph(preset: str) -> ir.Model:
    model = trace(load_source(preset))
    run_pipeline(model, "default", target="ort", kv_cache=True)
    return model


def _materialized(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


# slow: per-MatMul quantization against MatMulNBitsQuantizer on three presets; llama-tiny stays
@pytest.mark.parametrize(
    "preset, bits, symmetric, level",
    [
        ("llama-tiny", 4, False, 4),
        pytest.param("gpt2-tiny", 4, True, 0, marks=pytest.mark.slow),
        pytest.param("t5-tiny", 8, False, 4, marks=pytest.mark.slow),
    ],
)
def test_same_nodes_and_bytes_as_matmul_nbits_quantizer(preset, bits, symmetric, level):
    graph = _graph(preset)
    theirs = MatMulNBitsQuantizer(
        ir.serde.serialize_model(graph),
        bits=bits,
        block_size=32,
        is_symmetric=symmetric,
        accuracy_level=level,
    )
    theirs.process()
    want = ir.serde.deserialize_model(theirs.model.model)
    done = quantize_matmuls(graph, bits, block_size=32, symmetric=symmetric, accuracy_level=level)
    got = _materialized(graph)
    want_nodes = [n for n in want.graph if n.op_type == "MatMulNBits"]
    got_nodes = [n for n in got.graph if n.op_type == "MatMulNBits"]
    assert len(got_nodes) == len(want_nodes) == len(done) > 0
    for g, w in zip(got_nodes, want_nodes, strict=True):
        assert g.name == w.name
        assert [v.name for v in g.inputs] == [v.name for v in w.inputs]
        assert {k: a.value for k, a in g.attributes.items()} == {
            k: a.value for k, a in w.attributes.items()
        }
        for gv, wv in zip(g.inputs[1:], w.inputs[1:], strict=True):
            assert gv.const_value.tobytes() == wv.const_value.tobytes(), gv.name
    assert [n.op_type for n in got.graph] == [n.op_type for n in want.graph]
    assert sorted(got.graph.initializers) == sorted(want.graph.initializers)


def test_one_weight_quantized_at_a_time():
    """Writing the graph reads each fp32 weight once, and holds no quantized weight after its
    parts are written."""
    graph = _graph("llama-tiny")
    reads = []
    for value in graph.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None and len(tensor.shape) == 2:
            value.const_value = _Counted(tensor, reads)
    done = quantize_matmuls(graph, 4, block_size=32, symmetric=False, accuracy_level=4)
    assert not reads  # rewriting the graph reads nothing
    ir.serde.serialize_model(graph)
    quantized = sorted(weight.name for _, weight in done)
    assert sorted(r for r in reads if r in quantized) == quantized  # each once, for 3 parts
    assert all(h._value is None for h in _holders(graph))


class _Counted(ir.LazyTensor):
    def __init__(self, tensor, reads):
        def read():
            reads.append(tensor.name)
            return ir.Tensor(np.asarray(tensor.numpy()), name=tensor.name)

        super().__init__(read, dtype=tensor.dtype, shape=tensor.shape, name=tensor.name)


def _holders(graph):
    for value in graph.graph.initializers.values():
        raw = getattr(value.const_value, "raw", None)
        holder = getattr(raw, "__self__", None) if raw is not None else None
        if holder is not None and hasattr(holder, "_value"):
            yield holder


@pytest.mark.parametrize("bits, symmetric", [(4, False), (4, True), (8, False), (8, True)])
def test_rows_dequantized_with_torch_are_the_same_values(bits, symmetric):
    """The streamed reference's (N, K) dequantization equals :func:`dequantize` bit for bit
    (K not a multiple of the block: the padded last block is cut)."""
    from matmul_model import matmul_proto

    from tfgraph.exporters.ort.weights.dequantize import dequantize, dequantize_rows

    k, n = 72, 40
    w = np.random.default_rng(bits).standard_normal((k, n)).astype(np.float32)
    proto = matmul_proto(w)
    quantizer = MatMulNBitsQuantizer(proto, bits=bits, block_size=32, is_symmetric=symmetric)
    quantizer.process()
    model = ir.serde.deserialize_model(quantizer.model.model)
    node = next(x for x in model.graph if x.op_type == "MatMulNBits")
    want = dequantize(node, model.graph.initializers, (k, n))
    got = dequantize_rows(node, model.graph.initializers).numpy()
    assert got.shape == (n, k) and np.array_equal(got, want.T)
    assert np.abs(want - w).max() > 1e-4


def _linear_graph(n: int, k: int) -> ir.Model:
    """Y = X @ Wᵀ with W (n, k) a Linear's parameter and Wᵀ its lazy transpose, as a streamed
    checkpoint's graph holds it (:func:`tfgraph.passes.lazy_weights.transposed`)."""
    from tfgraph.passes.lazy_weights import transposed

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["b", k]))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 20}, name="g")
    rng = np.random.default_rng(0)
    param = ir.tensor(rng.standard_normal((n, k)).astype(np.float32), name="w")
    weight = transposed(graph, "w_t", param)
    node = ir.node("MatMul", [x, weight])
    node.outputs[0].name = "y"
    graph.append(node)
    graph.outputs.append(node.outputs[0])
    return ir.Model(graph, ir_version=10)


def test_a_transposed_weight_quantizes_in_column_chunks_to_the_same_bytes(monkeypatch):
    """A Linear's weight (the lazy transpose of its parameter) is quantized a few output
    columns at a time from the parameter's rows (a 250k-word head is never transposed whole):
    the same bytes as quantizing it whole."""
    import tfgraph.exporters.ort.weights.nbits as nbits

    want = _linear_graph(100, 64)
    quantize_matmuls(want, 4, block_size=32, symmetric=False, accuracy_level=4)
    want = _materialized(want)
    got = _linear_graph(100, 64)
    monkeypatch.setattr(nbits, "COLUMN_CHUNK", 24)  # 5 chunks, the last one short
    calls = []
    quantized = nbits._quantized
    monkeypatch.setattr(nbits, "_quantized", lambda *a: calls.append(1) or quantized(*a))
    quantize_matmuls(got, 4, block_size=32, symmetric=False, accuracy_level=4)
    got = _materialized(got)
    assert len(calls) == 5
    assert sorted(got.graph.initializers) == sorted(want.graph.initializers)
    for name, value in want.graph.initializers.items():
        assert got.graph.initializers[name].const_value.tobytes() == value.const_value.tobytes()
