"""AWQ and GPTQ checkpoints read as they ship (:mod:`tfgraph.sources.quantized_checkpoint`).

- the fixtures' writer (:mod:`tests.sources.quantized_checkpoints`) is proven by another
  reader: onnxruntime-genai's own AWQ / GPTQ loaders read the written directories and their
  ``MatMulNBits`` integers, scales and zero points dequantize to exactly the writer's weights,
  and are byte for byte what tfgraph repacks;
- unpack / dequantize round trip for AWQ, GPTQ (asymmetric, symmetric, ``desc_act``'s g_idx);
- ``load_source`` streams the directory with the quantized weights dequantized: its logits are
  exactly those of the Llama holding the writer's weights; loaded whole, the same;
- the formats tfgraph does not read are refused in one line;
- (slow) the int4 export keeps the shipped integers (its ``MatMulNBits`` dequantize to exactly
  the checkpoint's weights, no re-quantization), passes parity, and its logits are the builder's
  export of the same directory within the activation quantization's error.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.sources.quantized_checkpoints import tiny_llama, write
from tfgraph.errors import TfgraphError
from tfgraph.exporters.ort.weights.packing import pack, padded
from tfgraph.sources import quantized_checkpoint as qc

pytest.importorskip("transformers")

REFERENCE_MODEL = Path(__file__).resolve().parents[2] / "bench" / "reference_model"
CASES = {
    "awq": ("awq", {}),
    "gptq": ("gptq", {}),
    "gptq-sym": ("gptq", {"sym": True}),
    "gptq-desc_act": ("gptq", {"desc_act": True}),
}


@pytest.fixture(scope="module", params=list(CASES))
def written(request, tmp_path_factory):
    method, options = CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, write(directory, method, **options)


def _ort_dequantized(packed, scales, zeros, k: int) -> np.ndarray:
    """(N, K) of MatMulNBits' 4-bit layout, read here on its own (low nibble first)."""
    n, blocks, _ = packed.shape
    q = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n, -1)[:, :k]
    zp = np.stack([zeros & 0xF, zeros >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    group = np.arange(k) // -(-k // blocks)
    return ((q.astype(np.float32) - zp[:, group]) * scales.reshape(n, blocks)[:, group]).astype(
        np.float32
    )


def test_builder_reads_the_written_checkpoints(written):
    """onnxruntime-genai's AWQ / GPTQ loaders read the writer's directory: their repacked
    integers dequantize to the writer's weights, and equal tfgraph's repacking byte for byte
    (its scales in fp32)."""
    from onnxruntime_genai.models.loaders.quant_model import QuantModel

    name, directory, expected = written
    quant = json.loads((directory / "config.json").read_text())["quantization_config"]
    model = QuantModel.from_pretrained(
        quant["quant_method"], input_path=str(directory),
        quant_attrs={"config": quant, "use_g_idx": quant.get("desc_act", False)},
        q_size=64, kv_size=32, intermediate_size=128, num_layers=2,
    )  # fmt: skip
    checkpoint = qc.QuantizedCheckpoint(directory, qc.detect(directory))
    seen = 0
    for i, layer in enumerate(model.layers):
        for part in ("self_attn", "mlp"):
            for key, module in vars(getattr(layer, part)).items():
                if getattr(module, "qweight", None) is None:
                    continue
                prefix = f"model.layers.{i}.{part}.{key}"
                packed = module.qweight.numpy()
                scales = module.scales.float().numpy()
                zeros = module.qzeros.numpy()
                k = expected[f"{prefix}.weight"].shape[1]
                q, s, z, groups = checkpoint.unpacked(prefix)
                mine = pack(padded(q.T, 32), s, z, 4, 32)
                assert np.array_equal(packed, mine[0]), prefix
                assert np.array_equal(scales.reshape(mine[1].shape), mine[1]), prefix
                assert np.array_equal(zeros.reshape(mine[2].shape), mine[2]), prefix
                if groups is None:  # act-order's groups are not consecutive blocks
                    got = _ort_dequantized(packed, scales, zeros.reshape(mine[2].shape), k)
                    np.testing.assert_array_equal(got, expected[f"{prefix}.weight"])
                seen += 1
    assert seen == len(expected) == 14


def test_unpack_dequantize_round_trip(written):
    name, directory, expected = written
    fmt = qc.detect(directory)
    assert fmt.method == CASES[name][0] and fmt.group_size == 32
    checkpoint = qc.QuantizedCheckpoint(directory, fmt)
    assert set(checkpoint.quantized) == set(expected)
    for key, weight in expected.items():
        np.testing.assert_array_equal(checkpoint.tensor(key).numpy(), weight)
        groups = checkpoint.unpacked(key.removesuffix(".weight"))[3]
        assert (groups is not None) == (name == "gptq-desc_act")


def _llama_with(expected: dict) -> torch.nn.Module:
    model = tiny_llama()
    state = {k: v.half().float() for k, v in model.state_dict().items()}  # stored in fp16
    state.update({k: torch.from_numpy(v) for k, v in expected.items()})
    model.load_state_dict(state)
    return model


def test_source_is_the_dequantized_model(written):
    """load_source streams the quantized weights dequantized (exactly the writer's Llama), and
    records which parameters come with shipped integers; loaded whole, the same logits."""
    from tfgraph.sources.loading import load_source

    name, directory, expected = written
    source = load_source(directory)
    info = source.info["quantized_checkpoint"]
    assert info["format"] == f"{CASES[name][0]} checkpoint"
    assert info["parameters"] == sorted(expected)
    assert source.info["eager_reference"].startswith("streamed")
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    logits = source.eager({"input_ids": ids, "attention_mask": mask})["logits"]
    with torch.no_grad():
        reference = _llama_with(expected)(ids).logits
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-6)
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    qc.without_quantization(config)
    checkpoint = qc.QuantizedCheckpoint(directory, qc.detect(directory))
    whole = qc.load_whole(transformers.LlamaForCausalLM, config, {}, checkpoint)
    with torch.no_grad():
        torch.testing.assert_close(whole(ids).logits, reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"bits": 8}, "8-bit AWQ checkpoint"),
        ({"version": "gemv"}, "'gemv' layout"),
        ({"zero_point": False}, "without zero points"),
    ],
)
def test_unread_formats_are_refused(tmp_path, change, words):
    quant = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", **change}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
    with pytest.raises(TfgraphError, match=words) as caught:
        qc.detect(tmp_path)
    assert "\n" not in str(caught.value)


def test_gptq_layouts(tmp_path):
    quant = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
    assert qc.detect(tmp_path).zero_offset == 1  # the historical layout by default
    quant["checkpoint_format"] = "gptq_v2"
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
    assert qc.detect(tmp_path).zero_offset == 0
    quant["checkpoint_format"] = "marlin"
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
    with pytest.raises(TfgraphError, match="'marlin' layout"):
        qc.detect(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert qc.detect(tmp_path) is None


class _Derived:
    """A (K, N) graph weight made as the weights stage sees one (``tfgraph.derived`` meta)."""

    def __init__(self, op, arg, sources) -> None:
        from tfgraph.passes.lazy_weights import DERIVED

        self.meta = {DERIVED: (op, arg, sources)}


def test_shipped_rows(written):
    """The weights stage's view of a shipped Linear (the lazy transpose of its weight, or Q/K/V
    concatenated): the repacked shipped integers of each chunk of output rows, checked against
    the rows it reads; desc_act's reordered rows and another block size are quantized again."""
    name, directory, expected = written
    checkpoint = qc.QuantizedCheckpoint(directory, qc.detect(directory))
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    lazies = [checkpoint.lazy(n, torch.float32) for n in names]
    weight = _Derived("concat", 1, [_Derived("transpose", (1, 0), [t]) for t in lazies])
    assert qc.shipped_blocks(weight, 64) is None  # not the checkpoint's group size
    rows = qc.shipped_blocks(weight, 32)
    if name == "gptq-desc_act":
        assert rows is None
        return
    assert qc.shipped_label(weight) == f"{CASES[name][0]} checkpoint"
    full = np.concatenate([expected[n] for n in names])  # (N, K) rows of the fused weight
    parts = [rows(full[:48]), rows(full[48:])]  # two chunks, across the Q/K boundary
    parts = [pack(padded(q, 32), s, z, 4, 32) for q, s, z in parts]  # as the weights stage
    packed, scales, zeros = (np.concatenate(p) for p in zip(*parts, strict=True))
    got = _ort_dequantized(packed, scales, zeros, full.shape[1])
    np.testing.assert_array_equal(got, full)
    with pytest.raises(TfgraphError, match="not what its shipped integers dequantize to"):
        rows(full[1:17])  # out of order: refused, never silently replaced


# --- the export (slow: two exports and a builder run per format) ----------------------------


def _builder(directory: Path, out: Path) -> Path:
    """onnxruntime-genai's builder's int4 CPU export of ``directory`` (its LM head kept fp32,
    as the tfgraph export it is compared with)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the builder saves a tokenizer
        shutil.copy(REFERENCE_MODEL / name, directory / name)
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(directory),
           "-o", str(out), "-p", "int4", "-e", "cpu", "-c", str(out.parent / "cache"),
           "--extra_options", "nodes_to_exclude=/lm_head/MatMul"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return out / "model.onnx"


def _run(path: Path, ids: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for port in session.get_inputs():
        if port.name.startswith("past_key_values."):
            feeds[port.name] = np.zeros((ids.shape[0], port.shape[1], 0, 16), np.float32)
    return session.run(["logits"], feeds)[0]


@pytest.mark.slow  # two exports and an onnxruntime-genai builder run: ~60 s per format
@pytest.mark.parametrize("name", ["awq", "gptq"])
def test_export_keeps_the_shipped_integers(tmp_path, name):
    import onnx_ir as ir

    from tfgraph import export
    from tfgraph.exporters.ort.weights.dequantize import dequantize
    from tfgraph.sources.loading import load_source

    method, options = CASES[name]
    directory = tmp_path / name
    expected = write(directory, method, seed=1 if method == "gptq" else 0, **options)
    out = tmp_path / "out"
    result = export(directory, out, weights="int4", symmetric=False, block_size=64,
                    quantize_lm_head=False, quantize_embeddings=False)  # fmt: skip
    report = result.report
    assert report["parity"]["passed"]
    weights = report["weights"]
    assert weights["source_format"] == f"{method} checkpoint"
    assert weights["block_size"] == 32  # the checkpoint's group size, not --block-size 64
    assert "overridden" in weights["block_size_note"]
    assert weights["shipped_weights"] == 14
    model = ir.load(out / "model.onnx")
    nodes = {n.name: n for n in model.graph}
    seen = set()
    for entry in weights["parameters"]:
        node = nodes[entry["node"]]
        shape = (node.attributes.get_int("K"), node.attributes.get_int("N"))
        c0, c1 = entry["columns"]
        got = dequantize(node, model.graph.initializers, shape)[:, c0:c1].T
        key = entry["parameter"].removeprefix("model.")
        np.testing.assert_array_equal(got, expected[key])
        seen.add(key)
    assert seen == set(expected)
    ids = np.random.default_rng(0).integers(0, 256, (1, 24)).astype(np.int64)
    ours = _run(out / "model.onnx", ids)
    theirs = _run(_builder(directory, tmp_path / "builder"), ids)
    source = load_source(directory)
    eager = source.eager({"input_ids": torch.from_numpy(ids), "attention_mask": torch.ones(1, 24,
                          dtype=torch.int64)})["logits"].numpy()  # fmt: skip
    activation_error = max(np.abs(ours - eager).max(), np.abs(theirs - eager).max())
    assert np.abs(ours - theirs).max() <= 2 * activation_error + 1e-4
