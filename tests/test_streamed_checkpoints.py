"""Hugging Face safetensors directories are exported without ever holding the model whole.

- bf16 and fp16 checkpoints (Llama, Mistral, Qwen2) export through the streaming path with
  parity against the checkpoint upcast to fp32, on every target; the report names the
  reference and the checkpoint's dtype;
- the bytes an export materializes from the checkpoint at any one time stay below a layer's
  worth of the model (counted tensor by tensor, eager reference included), and the model is
  never loaded with ``from_pretrained``;
- a missing, truncated or mismatched shard is one line naming the file and tensor, with no
  output left behind;
- the random checkpoint writer's output loads in transformers as written;
- an artifact that could not be opened in the memory there is, or would not fit on the disk,
  is refused before any work, with the format that fits.
"""

import json
import weakref

import numpy as np
import pytest
import torch

import tfgraph
from tfgraph.cli import main
from tfgraph.sources import checkpoint as checkpoint_module
from tfgraph.tools.random_checkpoint import write_random_checkpoint

transformers = pytest.importorskip("transformers")

_SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
)
CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
}


def _config(arch: str):
    config_cls, model_cls, extra = CONFIGS[arch]
    config = getattr(transformers, config_cls)(**_SMALL, **extra)
    config.architectures = [model_cls]
    return config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for arch, dtype in [
        ("llama", "bf16"),
        ("mistral", "fp16"),
        ("qwen2", "bf16"),
        ("llama", "fp16"),
    ]:
        out[arch, dtype] = write_random_checkpoint(
            _config(arch), root / f"{arch}-{dtype}", dtype=dtype, shard_bytes=40_000
        )
    return out


@pytest.fixture
def no_whole_load(monkeypatch):
    """Loading a model whole (from_pretrained) fails the test."""
    from tfgraph.sources import huggingface

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded whole")

    monkeypatch.setattr(huggingface, "_load_hf_weights", refuse)


@pytest.mark.parametrize(
    "arch, dtype, target",
    [
        ("llama", "bf16", "ort"),
        ("mistral", "fp16", "ort"),
        ("qwen2", "bf16", "ort"),
        ("llama", "fp16", "onnx"),
        ("llama", "bf16", "tensorrt"),
        ("qwen2", "bf16", "ort-cuda"),
    ],
)
def test_low_precision_checkpoint_exports_with_parity(
    checkpoints, arch, dtype, target, tmp_path, no_whole_load
):
    result = tfgraph.export(
        str(checkpoints[arch, dtype]), tmp_path / "out", kv_cache=True, target=target
    )
    report = result.report
    assert result.passed, report["parity"]
    assert report["source"]["checkpoint_dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[dtype]
    assert "fp32" in report["source"]["eager_reference"]
    assert report["fusions"]["attention"]["fused"] == report["fusions"]["attention"]["total"] == 4
    if target in ("ort", "onnx"):  # runs here: the cache parity ran too
        assert max(o["max_abs_err"] for o in report["parity"]["outputs"]) < 1e-4


def test_same_graph_as_loading_whole(checkpoints, tmp_path):
    """The streamed export's graph equals the whole-loaded model's, node for node, with the
    same weight bytes (the checkpoint upcast to fp32)."""
    from pathlib import Path

    import onnx_ir as ir

    from tfgraph.sources.huggingface import _load_hf_weights, hf_source

    path = checkpoints["qwen2", "bf16"]
    streamed = tfgraph.export(str(path), tmp_path / "streamed", kv_cache=True)
    model = _load_hf_weights(transformers.Qwen2ForCausalLM, Path(path), False, None, {})
    model = model.float()
    whole = tfgraph.export(hf_source(model, origin=f"hf:{path}"), tmp_path / "whole", kv_cache=True)
    assert streamed.passed and whole.passed
    a = ir.load(tmp_path / "streamed" / "model.onnx")
    b = ir.load(tmp_path / "whole" / "model.onnx")
    assert [(n.op_type, n.domain) for n in a.graph] == [(n.op_type, n.domain) for n in b.graph]
    weights = lambda m: sorted(  # noqa: E731
        v.const_value.numpy().tobytes() for v in m.graph.initializers.values()
    )
    assert weights(a) == weights(b)


class _Live:
    """Bytes of checkpoint tensors alive at once, through both readers (the lazy graph
    weights and accelerate's offload loader)."""

    def __init__(self):
        self.now = self.peak = self.total = 0

    def track(self, tensor):
        if not isinstance(tensor, torch.Tensor):
            return tensor
        size = tensor.numel() * tensor.element_size()
        self.now += size
        self.total += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(tensor.untyped_storage(), self._free, size)
        return tensor

    def _free(self, size):
        self.now -= size


def test_export_never_holds_the_state_dict(tmp_path, monkeypatch, no_whole_load):
    from accelerate.utils import offload

    config = _config("llama")
    config.num_hidden_layers = 8
    path = write_random_checkpoint(config, tmp_path / "ck", dtype="bf16", shard_bytes=60_000)
    live = _Live()
    tensor = checkpoint_module.Checkpoint.tensor
    monkeypatch.setattr(
        checkpoint_module.Checkpoint,
        "tensor",
        lambda self, *a, **k: live.track(tensor(self, *a, **k)),
    )
    getitem = offload.OffloadedWeightsLoader.__getitem__
    monkeypatch.setattr(
        offload.OffloadedWeightsLoader,
        "__getitem__",
        lambda self, key: live.track(getitem(self, key)),
    )
    result = tfgraph.export(str(path), tmp_path / "out", kv_cache=True, weights="int4")
    assert result.passed
    fp32_model = sum(e.length for e in checkpoint_module.Checkpoint(path).entries.values()) * 2
    embedding = 2 * config.vocab_size * config.hidden_size * 4  # table + the head (fp32)
    layer = (fp32_model - embedding) / config.num_hidden_layers
    assert live.total > 3 * fp32_model  # every stage read the weights (trace, save, parity …)
    assert live.peak <= embedding + 2 * layer, (live.peak, fp32_model)  # never the whole model


def _cli(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_missing_shard_is_one_line(checkpoints, tmp_path, capsys):
    import shutil

    bad = tmp_path / "ck"
    shutil.copytree(checkpoints["llama", "bf16"], bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (bad / shard).unlink()
    code, out, err = _cli(["export", str(bad), "-o", str(tmp_path / "out")], capsys)
    assert code != 0 and "Traceback" not in err
    errors = [line for line in err.splitlines() if not line.startswith("[")]  # stage lines
    assert len(errors) == 1 and shard in errors[0] and "missing" in errors[0]
    assert not (tmp_path / "out").exists()


def test_truncated_shard_is_one_line(checkpoints, tmp_path, capsys):
    import shutil

    bad = tmp_path / "ck"
    shutil.copytree(checkpoints["llama", "bf16"], bad)
    shard = sorted(bad.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    code, out, err = _cli(["export", str(bad), "-o", str(tmp_path / "out")], capsys)
    assert code != 0 and "Traceback" not in err
    assert "truncated" in err and shard.name in err
    assert not (tmp_path / "out").exists()


def test_wrong_shape_is_one_line(checkpoints, tmp_path, capsys):
    import shutil

    bad = tmp_path / "ck"
    shutil.copytree(checkpoints["llama", "bf16"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(config))
    code, out, err = _cli(["export", str(bad), "-o", str(tmp_path / "out")], capsys)
    assert code != 0 and "Traceback" not in err
    assert "mlp.gate_proj.weight" in err and "[128, 64]" in err and "[96, 64]" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_random_checkpoint_loads_as_written(tmp_path, dtype):
    config = _config("qwen2")
    path = write_random_checkpoint(config, tmp_path / dtype, dtype=dtype, shard_bytes=50_000)
    assert (path / "model.safetensors.index.json").is_file()
    model = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    reader = checkpoint_module.Checkpoint(path)
    state = model.state_dict()
    assert set(reader.entries) <= set(state)
    for name in reader.entries:
        assert torch.equal(reader.tensor(name, torch.float32), state[name]), name
    weight = reader.tensor("model.layers.0.mlp.up_proj.weight", torch.float32)
    assert 0.015 < float(weight.std()) < 0.025  # initializer_range 0.02
    assert torch.equal(
        reader.tensor("model.norm.weight"),
        torch.ones(64, dtype=reader.entry("model.norm.weight").dtype),
    )


def test_artifact_too_big_for_memory_is_refused_first(checkpoints, tmp_path, capsys, monkeypatch):
    from tfgraph.exporters import budget

    monkeypatch.setattr(budget, "available_memory", lambda: 400_000)
    code, out, err = _cli(
        ["export", str(checkpoints["llama", "bf16"]), "-o", str(tmp_path / "o")], capsys
    )
    assert code != 0 and "Traceback" not in err
    assert "could not be opened" in err and "use --weights int" in err
    assert "[2/" not in err  # refused before the trace
    assert not (tmp_path / "o").exists()


def test_artifact_too_big_for_the_disk_is_refused_first(checkpoints, tmp_path, capsys, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10**6, 10**6 - 1000, 1000))
    code, out, err = _cli(
        ["export", str(checkpoints["llama", "bf16"]), "-o", str(tmp_path / "o")], capsys
    )
    assert code != 0 and "on disk" in err and "free" in err
    assert not (tmp_path / "o").exists()


def test_estimate_is_close_to_the_artifact(checkpoints, tmp_path):
    for weights in (None, "int4"):
        result = tfgraph.export(
            str(checkpoints["llama", "bf16"]),
            tmp_path / str(weights),
            weights=weights,
            external_data=True,
        )
        estimate = result.report["budget"]["estimated_artifact_bytes"]
        written = (tmp_path / str(weights) / "model.onnx.data").stat().st_size
        assert 0.8 < estimate / written < 1.25, (weights, estimate, written)


def test_progress_says_what_each_stage_took(checkpoints, tmp_path, capsys):
    code, out, err = _cli(
        ["export", str(checkpoints["llama", "bf16"]), "-o", str(tmp_path / "o"), "--kv-cache"],
        capsys,
    )
    assert code == 0
    for stage in ("load", "trace", "passes", "save", "parity"):
        assert any(
            line.startswith("[") and f"] {stage}: " in line and line.endswith(" s")
            for line in err.splitlines()
        ), (stage, err)


def test_streamed_int4_reference_is_rebuilt_from_the_artifact(checkpoints, tmp_path):
    """The dequantized reference streams from the checkpoint with the artifact's weights; a
    re-check from the artifact alone gives the export's figures."""
    from tfgraph.precision.weights import reference_from_artifact
    from tfgraph.sources import load_source

    path = checkpoints["qwen2", "bf16"]  # a tied head: quantized, the embedding stays
    result = tfgraph.export(str(path), tmp_path / "q", kv_cache=True, weights="int4")
    assert result.passed, result.report["parity"]
    params = result.report["weights"]["parameters"]
    head = [p for p in params if p["parameter"].endswith(("embed_tokens.weight", "lm_head.weight"))]
    assert len(head) == 1 and head[0]["transposed"]  # the tied head, quantized
    source = load_source(str(path))
    reference = reference_from_artifact(source, tmp_path / "q" / "model.onnx", params)
    inputs = source.inputs(1, 7)
    from tfgraph.runtime import CachedDecoder, open_runner

    decoder = CachedDecoder(open_runner(tmp_path / "q" / "model.onnx"))
    ids, mask = inputs["input_ids"].numpy(), inputs["attention_mask"].numpy()
    got, _ = decoder.step(ids, decoder.empty_cache(1, 7), mask, {})
    want = reference.eager(inputs)["logits"].numpy()
    assert np.abs(np.asarray(got) - want).max() < 1e-4
    fp32 = source.eager(inputs)["logits"].numpy()
    assert np.abs(fp32 - want).max() > 1e-3  # the reference is the quantized model, not fp32
