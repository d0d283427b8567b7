"""--check-each-pass: after every pass that changed the graph, a parity probe runs the graph in
ONNX Runtime on one small random input against the graph before the pipeline."""

import logging

import onnx_ir as ir
import pytest

from tfgraph import load_source
from tfgraph.exporters.compile import run_pipeline
from tfgraph.passes import PIPELINES
from tfgraph.passes.pipeline.run import CHECK_EACH_PASS_ENV, GraphCheckError
from tfgraph.sources.trace import trace

TEXT = """
<ir_version: 10, opset_import: ["" : 20]>
g (float[N, 4] x) => (float[N, 4] y) {
    b = Relu(x)
    y = Add(b, x)
}
"""


class AddBecomesSubPass(ir.passes.InPlacePass):
    """A well-typed graph that computes something else: only running it can tell."""

    def call(self, model):
        node = next(n for n in model.graph if n.op_type == "Add")
        node.op_type = "Sub"
        return ir.passes.PassResult(model, modified=True)


class LiesAboutModifiedPass(AddBecomesSubPass):
    def call(self, model):
        super().call(model)
        return ir.passes.PassResult(model, modified=False)


def test_probe_names_the_pass_that_changed_the_numbers(monkeypatch):
    monkeypatch.delenv(CHECK_EACH_PASS_ENV, raising=False)  # tests/conftest.py sets it
    monkeypatch.setitem(PIPELINES, "wrong", lambda target: [AddBecomesSubPass()])
    with pytest.raises(GraphCheckError, match="parity probe failed after AddBecomesSubPass"):
        run_pipeline(ir.from_onnx_text(TEXT), "wrong", check_each_pass=True)
    run_pipeline(ir.from_onnx_text(TEXT), "wrong")  # without the option: no probe


def test_probe_is_on_with_the_environment_variable(monkeypatch):
    monkeypatch.setitem(PIPELINES, "wrong", lambda target: [AddBecomesSubPass()])
    monkeypatch.setenv(CHECK_EACH_PASS_ENV, "1")
    with pytest.raises(GraphCheckError, match="after AddBecomesSubPass"):
        run_pipeline(ir.from_onnx_text(TEXT), "wrong")


def test_probe_trusts_an_unmodified_pass(monkeypatch):
    """The probe runs only when a pass says it changed the graph (cost); the check at the end
    of the pipeline is the parity against eager PyTorch."""
    monkeypatch.setitem(PIPELINES, "quiet", lambda target: [LiesAboutModifiedPass()])
    run_pipeline(ir.from_onnx_text(TEXT), "quiet", check_each_pass=True)


class FuseToCanonicalPass(ir.passes.InPlacePass):
    """Turns Relu into a canonical op that ONNX Runtime cannot run (the probe waits)."""

    def call(self, model):
        next(n for n in model.graph if n.op_type == "Relu").domain = "tfgraph"
        return ir.passes.PassResult(model, modified=True)


class LowerCanonicalPass(ir.passes.InPlacePass):
    def call(self, model):
        next(n for n in model.graph if n.domain == "tfgraph").domain = ""
        return ir.passes.PassResult(model, modified=True)


def test_probe_failure_lists_the_passes_it_could_not_run_after(monkeypatch):
    steps = [FuseToCanonicalPass(), AddBecomesSubPass(), LowerCanonicalPass()]
    monkeypatch.setitem(PIPELINES, "staged", lambda target: steps)
    model = ir.from_onnx_text(TEXT.replace('["" : 20]', '["" : 20, "tfgraph" : 1]'))
    want = (
        r"after LowerCanonicalPass \(or the unprobed FuseToCanonicalPass, AddBecomesSubPass\): "
        r"output 'y' changed"
    )
    with pytest.raises(GraphCheckError, match=want):
        run_pipeline(model, "staged", check_each_pass=True)


def test_default_pipeline_is_probed_around_canonical_ops(caplog):
    source = load_source("gpt-tiny")
    model = trace(source)
    with caplog.at_level(logging.INFO, logger="tfgraph.passes.pipeline"):
        run_pipeline(model, "default", check_each_pass=True)
    text = caplog.text
    assert "parity probe skipped after FuseNormsPass: canonical tfgraph ops present" in text
    assert "parity probe after LowerAttentionPass: 1 output(s) match" in text
    assert "parity probe after RemoveUnusedOpsetsPass: 1 output(s) match" in text
    assert "parity probe after IdentityEliminationPass" not in text  # unmodified: not probed
