"""Embedding tables in int4 (:mod:`tfgraph.exporters.ort.weights.gather_nbits`): the nodes,
names and bytes of ONNX Runtime's ``MatMulNBitsQuantizer`` asked for ``Gather``, on zoo presets
after their pipeline; the table the reference uses is what the kernel gathers; only embeddings
are taken."""

import numpy as np
import onnx_ir as ir
import pytest
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
from ort_run import ort_session

from tfgraph.exporters.compile import run_pipeline
from tfgraph.exporters.ort.weights.gather_nbits import (
    dequantize_table,
    is_embedding,
    quantize_embeddings,
)
from tfgraph.sources import load_source
from tfgraph.sources.trace import trace


def _graph(preset: str) -> ir.Model:
    model = trace(load_source(preset))
    run_pipeline(model, "default", target="ort", kv_cache=True)
    return model


def _materialized(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


@pytest.mark.parametrize("preset, symmetric", [("llama-tiny", False), ("gpt2-tiny", True)])
def test_same_nodes_and_bytes_as_the_quantizer_asked_for_gather(preset, symmetric):
    graph = _graph(preset)
    theirs = MatMulNBitsQuantizer(
        ir.serde.serialize_model(graph),
        block_size=32,
        is_symmetric=symmetric,
        op_types_to_quantize=("Gather",),
        quant_axes=(("Gather", 1),),
    )
    theirs.process()
    want = ir.serde.deserialize_model(theirs.model.model)
    done = quantize_embeddings(graph, block_size=32, symmetric=symmetric)
    got = _materialized(graph)
    want_nodes = [n for n in want.graph if n.op_type == "GatherBlockQuantized"]
    got_nodes = [n for n in got.graph if n.op_type == "GatherBlockQuantized"]
    assert len(got_nodes) == len(want_nodes) == len(done) == (2 if preset == "gpt2-tiny" else 1)
    for g, w in zip(got_nodes, want_nodes, strict=True):
        assert [v.name for v in g.inputs] == [v.name for v in w.inputs]
        assert {k: a.value for k, a in g.attributes.items()} == {
            k: a.value for k, a in w.attributes.items()
        }
        for gv, wv in zip(g.inputs, w.inputs, strict=True):
            if gv.const_value is not None:
                assert gv.const_value.dtype == wv.const_value.dtype, gv.name
                assert gv.const_value.tobytes() == wv.const_value.tobytes(), gv.name
    assert not any(n.op_type == "Gather" and n.inputs[0].is_initializer() for n in got.graph)


def _gather_session(table: np.ndarray, symmetric: bool, block: int):
    """A graph gathering rows of ``table`` through GatherBlockQuantized; its IR model."""
    model = ir.Model(ir.Graph([], [], nodes=[], opset_imports={"": 21}, name="g"), ir_version=10)
    graph = model.graph
    init = ir.Value(name="table", const_value=ir.Tensor(table, name="table"))
    graph.register_initializer(init)
    ids = ir.Value(name="ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([None]))
    graph.inputs.append(ids)
    node = ir.node("Gather", [init, ids], name="embed")
    node.metadata_props["pkg.torch.onnx.fx_node"] = "aten.embedding.default"
    graph.append(node)
    graph.outputs.append(node.outputs[0])
    node.outputs[0].name = "rows"
    node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    done = quantize_embeddings(model, block_size=block, symmetric=symmetric)
    assert len(done) == 1
    proto = ir.serde.serialize_model(model)
    return ort_session(proto), _materialized(model)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("width, block", [(128, 32), (80, 32)])  # 80: a partial last block
def test_dequantized_table_is_what_the_kernel_gathers(symmetric, width, block):
    rng = np.random.default_rng(width)
    table = rng.standard_normal((50, width)).astype(np.float32)
    table[3] = 0  # an all-zero row: scale 0
    session, model = _gather_session(table, symmetric, block)
    ids = np.array([0, 3, 49, 7, 7])
    kernel = session.run(None, {"ids": ids})[0]
    node = next(n for n in model.graph if n.op_type == "GatherBlockQuantized")
    ours = dequantize_table(node, model.graph.initializers)
    assert ours.shape == table.shape
    assert np.abs(kernel - ours[ids]).max() < 1e-6
    assert 1e-3 < np.abs(ours - table).max() < np.abs(table).max() / 4  # int4: near, not equal


def test_only_embedding_tables_are_taken():
    graph = _graph("llama-tiny")
    gathers = [n for n in graph.graph if n.op_type == "Gather"]
    assert sum(is_embedding(n) for n in gathers) == 1
    table = next(n for n in gathers if is_embedding(n))
    table.metadata_props["pkg.torch.onnx.fx_node"] = "aten.index_select.default"
    assert not is_embedding(table)  # a constant gathered by index (a rotary table) stays
    assert quantize_embeddings(graph, block_size=32, symmetric=False) == []
