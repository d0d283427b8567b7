"""fp16 exports proven against eager PyTorch in fp32 and in fp16 (``--precision fp16``).

Every zoo decoder and encoder-decoder, KV-cached (prefill and decode steps), and Hugging Face
GPT-2, Llama, T5 (cached) and BERT pass the precision's rule (``tfgraph.precision.islands.judge``:
within 4× eager fp16's own error of fp32 eager, plus 4 fp16 units at the output's scale), with
their fp32 islands reported; a residual stream beyond 65504 is caught and named by layer; a
cancellation is kept in fp32 by measurement. ONNX Runtime's CPU provider ran every artifact
(it computes MatMul and most elementwise ops in fp32 behind Casts: these check the graph's
types, range and islands, not GPU accumulation).
"""

import json

import numpy as np
import onnx
import pytest

import tfgraph
from tfgraph.cli import main
from tfgraph.models import PRESETS, describe
from tfgraph.precision.islands import ERROR_FACTOR

GENERATIVE = [n for n in PRESETS if describe(n)["family"] in ("decoder", "encoder-decoder")]


def _types(path) -> dict[str, int]:
    model = onnx.load(path, load_external_data=False)
    return {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}


def _check_fp16(result) -> dict:
    report = result.report
    parity = report["parity"]
    assert result.passed, parity["outputs"]
    assert report["precision"]["precision"] == "fp16"
    assert result.manifest["precision"] == "fp16"
    for out in parity["outputs"]:
        # the comparison means something: eager fp16 differs from fp32, the export is within
        # the stated factor of it
        assert out["eager_low_err"] > 0, out
        assert out["max_abs_err"] <= ERROR_FACTOR * out["eager_low_err"] + 1e-2, out
    return report


# slow: the zoo's fp16 sweep with the cache; llama-tiny stays (bart-tiny: 14 s)
@pytest.mark.parametrize(
    "preset",
    [p if p == "llama-tiny" else pytest.param(p, marks=pytest.mark.slow) for p in GENERATIVE],
)
def test_zoo_fp16_cached(tmp_path, preset):
    result = tfgraph.export(preset, tmp_path / "a", kv_cache=True, precision="fp16")
    report = _check_fp16(result)
    parity = report["parity"]
    assert parity["prefill"]["passed"] and parity["decode"]["passed"]
    types = _types(tmp_path / "a" / "model.onnx")
    pasts = [n for n in types if n.startswith("past_key_values")]
    assert pasts and all(types[n] == onnx.TensorProto.FLOAT16 for n in pasts)  # fp16 cache
    assert types["logits"] == onnx.TensorProto.FLOAT16
    greedy = parity["greedy"]  # 32 greedy tokens, counted (near ties are not judged)
    assert greedy["tokens"] > 0 and 0 <= greedy["equal_to_fp32_eager"] <= greedy["tokens"]


def _hf(tmp_path, cls: str, config):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    getattr(transformers, cls)(config).eval().save_pretrained(tmp_path / "hf")
    return str(tmp_path / "hf")


def _hf_configs():
    transformers = pytest.importorskip("transformers")
    return {
        "gpt2": ("GPT2LMHeadModel", transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4)),
        "llama": (
            "LlamaForCausalLM",
            transformers.LlamaConfig(
                vocab_size=300,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=256,
            ),
        ),  # fmt: skip
        "t5": (
            "T5ForConditionalGeneration",
            transformers.T5Config(
                vocab_size=300,
                d_model=64,
                d_kv=16,
                d_ff=128,
                num_layers=2,
                num_heads=4,
                decoder_start_token_id=0,
            ),
        ),  # fmt: skip
        "bert": (
            "BertModel",
            transformers.BertConfig(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
            ),
        ),  # fmt: skip
    }


# slow: HF architectures in fp16; gpt2 stays
@pytest.mark.parametrize(
    "name",
    [
        "gpt2",
        pytest.param("llama", marks=pytest.mark.slow),
        pytest.param("t5", marks=pytest.mark.slow),
        pytest.param("bert", marks=pytest.mark.slow),
    ],
)
def test_hugging_face_fp16(tmp_path, name):
    cls, config = _hf_configs()[name]
    cached = name != "bert"
    result = tfgraph.export(
        _hf(tmp_path, cls, config), tmp_path / "a", kv_cache=cached, precision="fp16"
    )
    report = _check_fp16(result)
    if cached:
        assert report["parity"]["prefill"]["passed"] and report["parity"]["decode"]["passed"]


def test_torch_nn_transformer_fp16(tmp_path):
    """PyTorch's own nn.Transformer, written nothing like the zoo: ONNX Runtime's
    NchwcTransformer crashed the process opening its fp16 graph until the runner disabled it."""
    import torch

    torch.manual_seed(0)
    module = torch.nn.Transformer(
        d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64,
        batch_first=True,
    ).eval()  # fmt: skip
    source = tfgraph.from_module(module, (torch.randn(2, 6, 32), torch.randn(2, 5, 32)))
    result = tfgraph.export(source, tmp_path / "a", precision="fp16")
    _check_fp16(result)


def test_residual_overflow_is_named_by_layer(tmp_path):
    result = tfgraph.export("tests.precision_models:loud_gpt", tmp_path / "a", precision="fp16")
    report = result.report
    overflow = report["precision"]["first_overflow"]
    assert overflow["module"] == "decoder.blocks.0.mlp.w2" and overflow["max_abs"] > 65504
    modules = {i["module"] for i in report["precision"]["islands"]}
    assert {"decoder.blocks.0", "decoder.blocks.1", "decoder.ln_f"} <= modules
    out = report["parity"]["outputs"][0]
    # eager .half() overflows (inf/NaN logits): the export, with its islands, does not
    assert out["eager_low_err"] == float("inf") and result.passed, out
    assert out["max_rel_err"] < 1e-2


def test_cancellation_is_kept_in_fp32_by_measurement(tmp_path):
    result = tfgraph.export("tests.precision_models:cancellation", tmp_path / "a", precision="fp16")
    islands = {i["op"]: i for i in result.report["precision"]["islands"]}
    assert "strays" in islands["Sub"]["reason"]  # the difference loses its digits in fp16
    assert "feeds island" in islands["Add"]["reason"]  # ... unless its input is exact
    assert result.passed
    out = result.report["parity"]["outputs"][0]
    assert out["max_abs_err"] < out["eager_low_err"] / 10  # better than eager .half()


# slow: 18 s; the zoo fp16 cached cases stay in the default tier
@pytest.mark.slow
def test_t5_bucket_arithmetic_stays_exact(tmp_path):
    result = tfgraph.export("t5-tiny", tmp_path / "a", precision="fp16")
    islands = result.report["precision"]["islands"]
    logs = [i for i in islands if i["op"] == "Log"]
    assert logs and all("index" in i["reason"] for i in logs), islands


def test_cli_precision_options(tmp_path, capsys):
    out = tmp_path / "a"
    assert (
        main(["export", "gpt-tiny", "-o", str(out), "--precision", "fp16", "--keep-io-types"]) == 0
    )
    printed = capsys.readouterr().out
    assert "precision fp16" in printed and "eager fp16 err" in printed
    types = _types(out / "model.onnx")
    assert types["logits"] == onnx.TensorProto.FLOAT  # kept at the edge
    report = json.loads((out / "report.json").read_text())
    assert report["precision"]["keep_io_types"] is True
    assert main(["run", str(out), "--input-ids", "1 2 3"]) == 0
    for argv, needle in [
        (["--precision", "bf16"], "does not take --precision bf16"),
        (["--keep-io-types"], "--keep-io-types needs --precision"),
    ]:
        bad = tmp_path / "bad"
        assert main(["export", "gpt-tiny", "-o", str(bad), *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
        assert not bad.exists()


def test_fp32_export_reports_fp32(tmp_path):
    result = tfgraph.export("gpt-tiny", tmp_path / "a")
    assert result.report["precision"] == {"precision": "fp32"}
    assert result.manifest["precision"] == "fp32"
    out = result.report["parity"]["outputs"][0]
    assert "atol" in out["tolerance"] and np.isfinite(out["max_abs_err"])
