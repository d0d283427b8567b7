"""The artifact contract: every input and output has a role in manifest.json, and a plain ONNX
Runtime loop driven by the manifest alone (no tfgraph runtime, no names guessed) generates
the same tokens as ``tfgraph.runtime.generate``."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

import tfgraph
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, generate

PROMPTS = [[5, 9, 2, 7], [3, 1]]
NEW = 6


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    out = {}
    for preset in ("gpt-tiny", "transformer-tiny", "t5-tiny"):
        path = tmp_path_factory.mktemp("roles") / preset
        assert tfgraph.export(preset, path, kv_cache=True).passed
        out[preset] = path
    return out


def _ports(entry: dict) -> dict:
    """(role, layer) → port, for one graph of the manifest."""
    return {(p["role"], p.get("layer")): p for p in entry}


def _left_pad(prompts):
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = p, 1
    return ids, mask


def manifest_greedy(artifact, prompts, new_tokens: int) -> list[list[int]]:
    """Greedy decoding from manifest.json's roles and kv_layout alone, on plain ONNX Runtime."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    step_graph = manifest["graphs"]["model.onnx"]
    inputs, outputs = _ports(step_graph["inputs"]), _ports(step_graph["outputs"])
    layout = step_graph["kv_layout"]
    # raw sessions, not tests/ort_run.py: the loop is what a plain consumer of the artifact
    # writes, with ONNX Runtime's defaults and nothing of tfgraph or its tests
    session = ort.InferenceSession(str(artifact / "model.onnx"))
    ids, mask = _left_pad(prompts)
    batch = len(prompts)
    fixed = {}  # inputs that stay the same every step
    encoder = manifest["graphs"].get("encoder.onnx")
    if encoder is not None:  # encoder-decoder: the encoder runs once, on the prompts
        enc_feed = {}
        for p in encoder["inputs"]:
            role = p["role"]
            assert role in ("encoder_token_ids", "encoder_attention_mask"), p
            enc_feed[p["name"]] = ids if role == "encoder_token_ids" else mask
        enc = ort.InferenceSession(str(artifact / "encoder.onnx"))
        values = enc.run(None, enc_feed)
        for p, value in zip(encoder["outputs"], values, strict=True):
            assert p["role"] in ("cross_key", "cross_value") and p["name"] in {
                q["name"] for q in step_graph["inputs"]
            }
            fixed[p["name"]] = value
        for p in step_graph["inputs"]:
            if p["role"] == "encoder_attention_mask":
                fixed[p["name"]] = mask
        tokens = np.zeros((batch, 1), np.int64)  # decoder start token 0
        mask = np.ones((batch, 1), np.int64)
    else:
        tokens = ids
    layers = sorted({layer for role, layer in inputs if role == "past_key"})
    capacity = tokens.shape[1] + new_tokens
    cache = {}
    for role in ("past_key", "past_value"):
        for layer in layers:
            shape = inputs[(role, layer)]["shape"]
            room = capacity if layout["kind"] == "shared" else 0
            cache[(role, layer)] = np.zeros((batch, shape[1], room, shape[3]), np.float32)
    past = 0
    chosen = []
    for _ in range(new_tokens):
        feed = dict(fixed)
        feed[inputs[("token_ids", None)]["name"]] = tokens
        if ("attention_mask", None) in inputs:
            feed[inputs[("attention_mask", None)]["name"]] = mask
        if ("past_length", None) in inputs:
            feed[inputs[("past_length", None)]["name"]] = np.array([past], np.int64)
        if ("past_lengths", None) in inputs:  # each row's own past length: here all equal
            feed[inputs[("past_lengths", None)]["name"]] = np.full(batch, past, np.int64)
        for key, value in cache.items():
            feed[inputs[key]["name"]] = value
        names = [o.name for o in session.get_outputs()]
        result = dict(zip(names, session.run(None, feed), strict=True))
        logits = result[outputs[("logits", None)]["name"]][:, -1]
        if layout["kind"] == "shared":  # present aliases past: write the new rows in place
            for present, past_name in layout["present_aliases_past"].items():
                key = next(k for k, p in inputs.items() if p["name"] == past_name)
                new = tokens.shape[1]
                cache[key][:, :, past : past + new] = result[present][:, :, past : past + new]
        else:  # present is past + new
            for present, past_name in layout["present_extends_past"].items():
                key = next(k for k, p in inputs.items() if p["name"] == past_name)
                cache[key] = result[present]
        past += tokens.shape[1]
        chosen.append(logits.argmax(-1))
        tokens = chosen[-1][:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
    return np.stack(chosen, 1).tolist()


@pytest.mark.parametrize("preset", ["gpt-tiny", "transformer-tiny", "t5-tiny"])
def test_manifest_alone_drives_generation(cached, preset):
    artifact = cached[preset]
    got = manifest_greedy(artifact, PROMPTS, NEW)
    decoder = CachedDecoder(Session(artifact))
    extra = {}
    if decoder.seq2seq:
        from tfgraph.runtime.generate import left_pad

        extra = decoder.encoder_feeds(*left_pad(PROMPTS, 0))
        prompts = [[0]] * len(PROMPTS)
    else:
        prompts = PROMPTS
    want = generate(decoder, prompts, GenerationConfig(max_new_tokens=NEW), extra=extra).tokens
    assert got == want


@pytest.mark.parametrize("preset", ["gpt-tiny", "t5-tiny"])
def test_every_input_and_output_has_a_role(cached, preset):
    manifest = json.loads((cached[preset] / "manifest.json").read_text())
    graphs = manifest["graphs"]
    step = graphs["model.onnx"]
    roles = {(p["role"], p.get("layer")) for p in step["inputs"] + step["outputs"]}
    assert ("token_ids", None) in roles and ("logits", None) in roles
    assert not [p for p in step["inputs"] + step["outputs"] if p["role"] in ("input", "output")]
    layers = sorted(p["layer"] for p in step["inputs"] if p["role"] == "past_key")
    assert layers == list(range(len(layers))) and layers
    assert {("present_key", i) for i in layers} <= roles
    if preset == "gpt-tiny":
        assert step["kv_layout"]["kind"] == "shared"
        assert ("past_length", None) in roles
        aliases = step["kv_layout"]["present_aliases_past"]
        assert aliases == {
            f"present.{i}.{kv}": f"past_key_values.{i}.{kv}"
            for i in layers
            for kv in ("key", "value")
        }
    else:  # T5: the encoder returns only the cross K/V, one pair per decoder layer
        encoder = graphs["encoder.onnx"]
        out = [(p["role"], p["layer"]) for p in encoder["outputs"]]
        assert sorted(out) == sorted((r, i) for i in layers for r in ("cross_key", "cross_value"))
        assert {p["role"] for p in encoder["inputs"]} <= {
            "encoder_token_ids",
            "encoder_attention_mask",
        }
        cross_in = sorted(p["layer"] for p in step["inputs"] if p["role"] == "cross_key")
        assert cross_in == layers
