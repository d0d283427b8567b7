"""Fusion candidate counting on tiny hand-written graphs."""

import onnx_ir as ir

from tfgraph.exporters.compile import count_fusions
from tfgraph.passes.pipeline.fusions import MISS_REASON_KEY, op_histogram

TEXT = """
<ir_version: 10, opset_import: ["" : 20]>
g (float[N, 8] x, float[8] w, float[8] b) => (float[N, 8] y) {
    s = Softmax<axis = -1>(x)
    two = Constant<value = float {2.0}>()
    sq = Pow(s, two)
    ms = ReduceMean<keepdims = 1>(sq, axes)
    ln = LayerNormalization<axis = -1>(x, w, b)
    sq2 = Mul(ln, ln)
    ms2 = ReduceMean<keepdims = 1>(sq2, axes)
    cube = Pow(ms2, three)
    ms3 = ReduceMean<keepdims = 1>(cube, axes)
    y = Add(ms, ms3)
}
"""


def _model():
    text = TEXT.replace("(sq, axes)", "(sq)").replace("(sq2, axes)", "(sq2)")
    text = text.replace("(cube, axes)", "(cube)").replace("Pow(ms2, three)", "Pow(ms2, two)")
    return ir.from_onnx_text(text)


def test_counts_candidates_and_fused():
    model = _model()
    fusions = count_fusions(model, "none")
    assert fusions["attention"]["fused"] == 0
    assert fusions["attention"]["total"] == 1
    reason = fusions["attention"]["missed"][0]["reason"]
    assert reason == "no attention fusion pass in pipeline 'none'"
    # LayerNormalization is fused; ReduceMean(Pow(.,2)) and ReduceMean(Mul(a,a)) are norms
    # left decomposed; the third ReduceMean is of a square too (Pow(ms2, 2)).
    assert fusions["norm"]["fused"] == 1
    assert fusions["norm"]["total"] == 4
    assert op_histogram(model)["ReduceMean"] == 3


def test_reason_from_pass_metadata():
    model = _model()
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    softmax.metadata_props[MISS_REASON_KEY] = "mask is data-dependent"
    missed = count_fusions(model)["attention"]["missed"]
    assert missed == [{"module": "", "reason": "mask is data-dependent"}]
