"""Recurrent and hybrid Hugging Face models exported cached: the canonical recurrent ops fused
per layer, their states in the manifest, cache parity, and 32 greedy tokens for two
left-padded prompts equal to Hugging Face ``generate``
(passes/insert_recurrent_state.py, passes/lower_recurrent.py)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402

import tfgraph  # noqa: E402
from tfgraph import contract  # noqa: E402
from tfgraph.tools.coverage import tiny_config  # noqa: E402
from tfgraph.tools.coverage_generation import greedy_vs_hf  # noqa: E402

# model type → (conv layers, recurrences, attention layers) of its tiny build
MODELS = {
    "qwen3_next": (1, 1, 1),  # Gated DeltaNet (gated_delta) + gated full attention
    "mamba": (2, 2, 0),  # Mamba-1: per-channel scan, no attention at all
    "bamba": (1, 1, 1),  # Mamba-2's SSD as a gated rule, and its one attention layer
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("recurrent_hf")
    built = {}
    for model_type in MODELS:
        torch.manual_seed(0)
        config = tiny_config(model_type, "causal-lm")
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        model.save_pretrained(root / model_type / "hf")
        built[model_type] = (root / model_type, model)
    return built


def _roles(artifact):
    graph = json.loads((artifact / "manifest.json").read_text())["graphs"]["model.onnx"]
    return graph, {p["name"]: (p["role"], p.get("shape")) for p in graph["inputs"]}


# slow: bamba (19 s): its Mamba-2 SSD lowers to the same gated LinearAttention rule as
# qwen3_next's Gated DeltaNet, which stays, with mamba's per-channel scan
@pytest.mark.parametrize(
    "model_type",
    [pytest.param(m, marks=pytest.mark.slow) if m == "bamba" else m for m in sorted(MODELS)],
)
def test_cached_recurrent_model_generates_what_hugging_face_generates(model_type, hf_models):
    work, model = hf_models[model_type]
    convs, recurrences, attention = MODELS[model_type]
    result = tfgraph.export(str(work / "hf"), work / "cached", kv_cache=True, target="ort")
    fusions = result.report["fusions"]
    assert fusions["recurrent"]["fused"] == fusions["recurrent"]["total"] == convs + recurrences
    assert fusions["recurrent"]["missed"] == []
    assert fusions["attention"]["fused"] == fusions["attention"]["total"] == attention
    assert result.report["parity"]["passed"]
    manifest, inputs = _roles(work / "cached")
    conv_states = [n for n, (r, _) in inputs.items() if r == contract.PAST_CONV_STATE]
    states = [n for n, (r, _) in inputs.items() if r == contract.PAST_RECURRENT_STATE]
    assert (len(conv_states), len(states)) == (convs, recurrences)
    for name in conv_states + states:  # fixed size: only the batch is symbolic
        shape = inputs[name][1]
        assert isinstance(shape[0], str) and all(isinstance(d, int) for d in shape[1:]), shape
    outputs = {p["role"] for p in manifest["outputs"]}
    assert {contract.PRESENT_CONV_STATE, contract.PRESENT_RECURRENT_STATE} <= outputs
    ops = {(n.domain, n.op_type) for n in _graph(work / "cached")}
    assert ("com.microsoft", "LinearAttention") in ops
    assert ("com.microsoft", "CausalConvWithState") in ops
    tokens = greedy_vs_hf(work, model, "causal-lm")
    assert tokens["tokens_equal"], tokens


def _graph(artifact):
    import onnx

    return onnx.load(str(artifact / "model.onnx"), load_external_data=False).graph.node


def test_state_is_flat_in_the_past(hf_models):
    """A decode step's recurrent state has the same size at past 8 and past 200; the KV of the
    attention layer grows."""
    import numpy as np

    from tfgraph.runtime import CachedDecoder, Session

    work, _ = hf_models["qwen3_next"]
    if not (work / "cached").is_dir():
        tfgraph.export(str(work / "hf"), work / "cached", kv_cache=True, target="ort")
    decoder = CachedDecoder(Session(work / "cached"))
    sizes = {}
    for past in (8, 200):
        cache = decoder.empty_cache(1, past + 1)
        _, cache = decoder.step(np.full((1, past), 5, np.int64), cache)
        _, cache = decoder.step(np.full((1, 1), 7, np.int64), cache)
        sizes[past] = {
            key[0]: int(np.prod(decoder.session.to_numpy(v).shape))
            for key, v in cache.values.items()
        }
    for role in contract.STATE_ROLES:
        assert sizes[8][role] == sizes[200][role] > 0
    assert sizes[200][contract.PAST_KEY] > sizes[8][contract.PAST_KEY]


# slow: qwen3_next (16 s); mamba's Scan stays in the default tier
@pytest.mark.parametrize(
    "model_type", [pytest.param("qwen3_next", marks=pytest.mark.slow), "mamba"]
)
def test_standard_onnx_carries_the_state_in_a_scan(model_type, hf_models, tmp_path):
    """The ``onnx`` target has no recurrent kernel: a Scan over the tokens and a Conv, each
    reported missed with the reason, with the same states, cache parity and tokens."""
    work, model = hf_models[model_type]
    convs, recurrences, _ = MODELS[model_type]
    out = tmp_path / "cached"
    result = tfgraph.export(str(work / "hf"), out, kv_cache=True, target="onnx")
    fusions = result.report["fusions"]["recurrent"]
    assert (fusions["fused"], fusions["total"]) == (0, convs + recurrences)
    assert len(fusions["missed"]) == convs + recurrences
    assert all("standard ONNX has no recurrent kernel" in m["reason"] for m in fusions["missed"])
    assert result.report["parity"]["passed"]
    ops = [n.op_type for n in _graph(out) if n.domain in ("", "ai.onnx")]
    assert ops.count("Scan") == recurrences and ops.count("Conv") == convs
    (tmp_path / "hf").symlink_to(work / "hf")
    tokens = greedy_vs_hf(tmp_path, model, "causal-lm")
    assert tokens["tokens_equal"], tokens
