"""tfgraph as one of the ``exporters`` section's peers: its cached artifact (the ``ort`` target's
shared KV buffer, or the ``onnx`` target's static cache) and the feeds of its prefill and
decode-step probes, each input found by the role the manifest gives it."""

from __future__ import annotations

import json
from pathlib import Path

from tfgraph.bench.exporter_probes import (
    ENCODER_LENGTH,
    PREFILL,
    STATIC_CAPACITY,
    graph_inputs,
    kv_shape,
    node_count,
)


def tfgraph_peer(src: Path, kind: str, work: Path, high: int = 900, **options) -> dict:
    """``options``: more ``tfgraph.export`` arguments (``precision``, ``weights``). In a quick
    run, exports of one ``src`` share its source and traces (:mod:`tfgraph.bench.shared`)."""
    from tfgraph.bench import shared

    out = work / "tfgraph"
    result = shared.export(str(src), out, kv_cache=True, **options)
    if not result.passed:
        raise RuntimeError("tfgraph's parity check failed")
    return tfgraph_graphs(out, kind, high)


def tfgraph_graphs(out: Path, kind: str, high: int = 900) -> dict:
    """The prefill and decode-step probes of a cached tfgraph artifact in ``out``."""
    manifest = json.loads((out / "manifest.json").read_text())
    roles = {i["name"]: i.get("role") for i in manifest["graphs"]["model.onnx"]["inputs"]}
    bind = manifest.get("kv_layout", {}).get("present_aliases_past") or {}
    shared = bool(bind)
    static = manifest.get("kv_layout", {}).get("kind") == "static"
    step_graph = out / "model.onnx"

    def feeds(tokens: int, past: int) -> tuple[Path, dict, dict]:
        inputs = {}
        for name, dtype, dims in graph_inputs(step_graph):
            role = roles.get(name)
            if role == "token_ids":
                inputs[name] = {"shape": [1, tokens], "dtype": dtype, "high": high}
            elif role == "attention_mask":
                inputs[name] = {"shape": [1, past + tokens], "dtype": dtype, "fill": "ones"}
            elif role in ("encoder_attention_mask", "encoder_slot_mask"):  # every position
                inputs[name] = {"shape": [1, ENCODER_LENGTH], "dtype": dtype, "fill": "ones"}
            elif role == "position_ids":
                inputs[name] = {"shape": [1, tokens], "dtype": dtype, "fill": {"arange": past}}
            elif role in ("past_key", "past_value"):
                # GQA's shared buffer: as long as needed; a static cache: its fixed capacity
                length = (STATIC_CAPACITY if static else past + tokens) if shared else past
                inputs[name] = {"shape": kv_shape(dims, 1, length), "dtype": dtype}
            elif role in ("cross_key", "cross_value"):
                inputs[name] = {"shape": kv_shape(dims, 1, ENCODER_LENGTH), "dtype": dtype}
            elif role == "past_length":
                inputs[name] = {"shape": [1], "dtype": dtype, "fill": {"value": past}}
            elif role == "past_lengths":  # each row's own: the one row's
                inputs[name] = {"shape": [1], "dtype": dtype, "fill": {"value": past}}
            else:
                raise RuntimeError(f"tfgraph input '{name}' (role {role}) has no probe feed")
        return step_graph, inputs, bind if shared else {}

    def prefill() -> tuple[Path, dict, dict]:
        if kind == "seq2seq":
            encoder = out / "encoder.onnx"
            inputs = {
                name: {"shape": [1, PREFILL], "dtype": dtype, "high": high}
                for name, dtype, _ in graph_inputs(encoder)
            }
            return [(encoder, inputs, {}), feeds(1, 0)]  # the encoder, then the first step
        return feeds(PREFILL, 0)

    return {"nodes": node_count(step_graph), "prefill": prefill, "step": lambda p: feeds(1, p)}
