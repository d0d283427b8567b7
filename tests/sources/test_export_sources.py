"""End to end: each model source → trace → pipeline → ONNX → parity against eager PyTorch."""

import json

import onnx_ir as ir
import pytest

import tfgraph
from tfgraph.exporters.compile import check_model
from tfgraph.verify.parity import FP32

REPORT_KEYS = {"parity", "fusions", "kv_cache", "target", "opset"}


def _check_artifact(result, *, files=("model.onnx",)):
    out = result.out_dir
    for name in (*files, "manifest.json", "report.json"):
        assert (out / name).is_file(), name
    report = json.loads((out / "report.json").read_text())
    assert REPORT_KEYS <= set(report)
    assert report["parity"]["passed"] is True
    assert report["kv_cache"] is False
    for row in report["parity"]["outputs"]:
        assert row["max_abs_err"] <= FP32.atol + FP32.rtol * 100, row
        assert set(row) >= {"name", "max_abs_err", "max_rel_err", "tolerance"}
    # two shapes, every output, each compared
    shapes = {(c["batch"], c["sequence"]) for c in report["parity"]["cases"]}
    assert shapes == {(1, 7), (2, 33)}
    for kind in ("attention", "norm"):
        f = report["fusions"][kind]
        assert f["fused"] + sum(not m.get("excluded") for m in f["missed"]) == f["total"]
    model = ir.external_data.load_to_model(ir.load(out / "model.onnx"))
    check_model(model, "the saved artifact")  # checker + strict shape inference
    return report


def test_preset_exports_with_parity(gpt_artifact):
    report = _check_artifact(gpt_artifact)
    # gpt-tiny: 2 layers → 2 attention cores, 5 LayerNorms (2 per block + final), all fused
    fusions = report["fusions"]
    assert (fusions["attention"]["fused"], fusions["attention"]["total"]) == (2, 2)
    assert (fusions["norm"]["fused"], fusions["norm"]["total"]) == (5, 5)
    layers = fusions["attention"]["fused_layers"]  # one per layer, named after its module
    assert [(x["module"], x["op"]) for x in layers] == [
        ("decoder.blocks.0.attn", "GroupQueryAttention"),
        ("decoder.blocks.1.attn", "GroupQueryAttention"),
    ]
    manifest = gpt_artifact.manifest
    assert manifest["inputs"] == [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]}
    ]
    assert manifest["outputs"][0]["shape"] == ["batch", "sequence", 256]
    assert manifest["opsets"][""] == 20
    assert manifest["versions"]["tfgraph"] == tfgraph.__version__
    assert {"torch", "onnx", "onnxruntime", "onnx-ir", "onnxscript"} <= set(manifest["versions"])
    assert [p["name"] for p in manifest["passes"]][0] == "IdentityEliminationPass"
    assert all(p["seconds"] >= 0 for p in manifest["passes"])


def test_factory_module_only(tmp_path):
    result = tfgraph.export("factories:tiny_lm", tmp_path / "a")
    _check_artifact(result)
    assert result.manifest["inputs"][0]["name"] == "tokens"
    assert result.manifest["model"] == "factory:factories:tiny_lm"


def test_factory_with_example_inputs_and_external_data(tmp_path):
    result = tfgraph.export("factories:tiny_lm_with_inputs", tmp_path / "b", external_data=True)
    _check_artifact(result, files=("model.onnx", "model.onnx.data"))
    assert (tmp_path / "b" / "model.onnx").stat().st_size < 20_000  # the weights live outside


def test_factory_using_zoo_protocol(tmp_path):
    report = _check_artifact(tfgraph.export("factories:zoo_gpt", tmp_path / "c"))
    assert report["fusions"]["attention"]["total"] == 2


def test_hf_directory(hf_gpt2_dir, tmp_path):
    result = tfgraph.export(str(hf_gpt2_dir), tmp_path / "hf")
    report = _check_artifact(result)
    assert result.manifest["outputs"][0]["shape"] == ["batch", "sequence", 50257]
    assert report["fusions"]["attention"]["fused"] == report["fusions"]["attention"]["total"] == 2
    assert report["fusions"]["norm"]["total"] == 5
    modules = [x["module"] for x in report["fusions"]["attention"]["fused_layers"]]
    assert modules == ["model.transformer.h.0.attn", "model.transformer.h.1.attn"]


def _save(tmp_path, cls_name, config_name, **config):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / cls_name
    config = getattr(transformers, config_name)(**config)
    getattr(transformers, cls_name)(config).eval().save_pretrained(path)
    return path


def test_hf_encoder_with_attention_mask(tmp_path):
    path = _save(
        tmp_path,
        "BertModel",
        "BertConfig",
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=500,
    )
    result = tfgraph.export(str(path), tmp_path / "out")
    _check_artifact(result)
    assert [i["name"] for i in result.manifest["inputs"]] == ["input_ids", "attention_mask"]
    assert result.manifest["outputs"][0]["name"] == "last_hidden_state"


# slow: 28 s (a T5 traced twice); the fallback's cases in the same-graph and coverage sweeps
@pytest.mark.slow
def test_hf_encoder_decoder_falls_back_to_eager_attention(tmp_path, caplog):
    path = _save(
        tmp_path,
        "T5ForConditionalGeneration",
        "T5Config",
        num_layers=2,
        d_model=64,
        num_heads=4,
        d_kv=16,
        d_ff=128,
        vocab_size=500,
    )
    result = tfgraph.export(str(path), tmp_path / "out")
    report = _check_artifact(result)
    names = [i["name"] for i in result.manifest["inputs"]]
    assert names == ["input_ids", "decoder_input_ids"]
    assert result.manifest["inputs"][1]["shape"] == ["batch", "decoder_sequence"]
    # transformers' sdpa T5 does not trace with dynamic shapes; the fallback is reported
    if report["source"].get("attn_fallback"):
        assert "retrying with eager attention" in caplog.text
    assert report["fusions"]["attention"]["total"] == 6  # enc self, dec self, dec cross × 2


def test_an_encoder_decoder_config_states_its_decoders_position_limit():
    """EncoderDecoderModel (bert2bert) has no limit of its own: the decoder's is the KV cache's
    (without it, BERT's sliced position_ids buffer made its cached decode steps wrong)."""
    transformers = pytest.importorskip("transformers")
    from tfgraph.sources import max_positions

    bert = transformers.BertConfig(max_position_embeddings=96)
    both = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(bert, bert)
    assert max_positions(both) == 96


def test_a_trace_cache_traces_once_per_opset(tmp_path):
    """Exports of one source through a TraceCache trace it once per opset; each export gets a
    copy (the passes rewrite in place), so the first artifact is not touched by the second."""
    import idiom_models

    from tfgraph.sources import from_module
    from tfgraph.sources.trace import TraceCache

    source = from_module(idiom_models.gpt(), origin="idiom:gpt")
    cache = TraceCache()
    plain = tfgraph.export(source, tmp_path / "plain", trace_cache=cache)
    cached = tfgraph.export(source, tmp_path / "cached", kv_cache=True, trace_cache=cache)
    standard = tfgraph.export(source, tmp_path / "onnx", target="onnx", trace_cache=cache)
    assert cache.hits == 1  # the KV-cached export reused the ort trace; onnx (opset 23) traced
    assert plain.passed and cached.passed and standard.passed
    assert "trace" in cached.report["timings"]
    first = ir.load(tmp_path / "plain" / "model.onnx")
    assert not [v for v in first.graph.inputs if v.name.startswith("past_key_values")]
