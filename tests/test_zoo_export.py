"""Every zoo preset exports through the pipeline with no fusion passes and passes fp32 parity.

Encoder-decoder presets export as one graph (encoder and decoder together, inputs
``input_ids``, ``decoder_input_ids``, ``attention_mask``), so parity covers the whole model.
"""

import pytest

import tfgraph
from tfgraph.models import PRESETS


def _expected_attention_cores(cfg) -> int:
    per_layer = {"decoder": 1, "encoder": 1, "encoder-decoder": 3}[cfg.family]
    return per_layer * cfg.n_layers


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_exports_with_parity(name, tmp_path):
    result = tfgraph.export(name, tmp_path / name, pipeline="none")
    report = result.report
    assert report["parity"]["passed"], report["parity"]["outputs"]
    assert {(c["batch"], c["sequence"]) for c in report["parity"]["cases"]} == {(1, 7), (2, 33)}
    for row in report["parity"]["outputs"]:
        assert row["max_abs_err"] < 1e-3, row  # fp32: well inside atol + rtol·|eager|
    assert report["passes"] == []  # pipeline "none": the graph as traced
    # one attention core per attention layer, each named after its PyTorch module
    attention = report["fusions"]["attention"]
    assert attention["total"] == _expected_attention_cores(PRESETS[name])
    modules = [m["module"] for m in attention["missed"]]
    assert all(m.endswith("attn") for m in modules), modules
    assert len(set(modules)) == len(modules)
    names = [i["name"] for i in result.manifest["inputs"]]
    assert names == list(tfgraph.load_source(name).input_names)
