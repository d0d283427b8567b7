"""Pass pipelines: timing records, honest `modified`, checks that name the breaking pass."""

import onnx_ir as ir
import pytest

from tfgraph import TfgraphError
from tfgraph.exporters.compile import run_pipeline
from tfgraph.passes import PIPELINES
from tfgraph.passes.pipeline.run import GraphCheckError

TEXT = """
<ir_version: 10, opset_import: ["" : 20]>
g (float[N, 4] x) => (float[N, 4] y) {
    a = Identity(x)
    b = Relu(a)
    c = Relu(a)
    y = Add(b, c)
}
"""


def test_cleanup_pipeline_records_and_rewrites():
    model = ir.from_onnx_text(TEXT)
    records = run_pipeline(model, "cleanup", check_each_pass=True)
    assert [r.name for r in records] == [type(p).__name__ for p in PIPELINES["cleanup"]("ort")]
    assert all(r.seconds >= 0 for r in records)
    by_name = {r.name: r.modified for r in records}
    assert by_name["IdentityEliminationPass"] is True
    assert by_name["CommonSubexpressionEliminationPass"] is True
    assert [n.op_type for n in model.graph] == ["Relu", "Add"]
    # a second run finds nothing to do
    assert not any(r.modified for r in run_pipeline(model, "cleanup"))


def test_unknown_pipeline():
    with pytest.raises(TfgraphError, match="unknown pipeline 'fast'"):
        run_pipeline(ir.from_onnx_text(TEXT), "fast")


class BreakGraphPass(ir.passes.InPlacePass):
    """Feeds Add a (3,) tensor where a (2, 4) one is expected: shapes no longer broadcast."""

    def call(self, model):
        node = next(n for n in model.graph if n.op_type == "Add")
        bad = ir.Value(name="bad", const_value=ir.tensor([1.0, 2.0, 3.0]))
        model.graph.register_initializer(bad)
        node.replace_input_with(1, bad)
        return ir.passes.PassResult(model, modified=True)


def test_check_each_pass_names_the_breaking_pass(monkeypatch):
    monkeypatch.setitem(PIPELINES, "broken", lambda target: [BreakGraphPass()])
    model = ir.from_onnx_text(TEXT.replace("[N, 4]", "[2, 4]"))
    with pytest.raises(GraphCheckError, match="after BreakGraphPass"):
        run_pipeline(model, "broken", check_each_pass=True)
