"""``--weights mixed``: the weights most sensitive on the calibration text go int8 (up to the
share asked), the rest int4; the export passes parity."""

import json

import onnx

import tfgraph
from tfgraph.exporters.ort.weights.mixed import choose


def test_choose_takes_the_most_sensitive_within_the_share():
    measured = [
        {"node": "a", "sensitivity": 0.9, "elements": 60},  # too large for the share
        {"node": "b", "sensitivity": 0.5, "elements": 10},
        {"node": "c", "sensitivity": 0.4, "elements": 10},
        {"node": "d", "sensitivity": 0.1, "elements": 20},
    ]
    assert choose(measured, 0.25) == {"b", "c"}
    assert choose(measured, 0.0) == set()


def test_mixed_export(tmp_path, tiny_llama_dir, calibration_text):
    out = tmp_path / "mixed"
    result = tfgraph.export(
        str(tiny_llama_dir),
        out,
        weights="mixed",
        calibration_text=str(calibration_text),
        int8_share=0.25,
    )
    assert result.passed
    weights = json.loads((out / "report.json").read_text())["weights"]
    rows = weights["mixed"]["sensitivity"]
    eight = {r["node"] for r in rows if r["bits"] == 8}
    assert eight and len(eight) < len(rows)
    assert 0 < weights["mixed"]["int8_held"] <= 0.25
    values = [r["sensitivity"] for r in rows]
    assert values == sorted(values, reverse=True) and values[0] > values[-1] > 0
    assert rows[0]["bits"] == 8 or rows[0]["module"].endswith("lm_head")  # the largest may not fit
    model = onnx.load(out / "model.onnx", load_external_data=False)
    bits = {
        n.name: next(a.i for a in n.attribute if a.name == "bits")
        for n in model.graph.node
        if n.op_type == "MatMulNBits"
    }
    assert {name.removesuffix("_Q8") for name, b in bits.items() if b == 8} == eight
    assert sorted(set(bits.values())) == [4, 8]
