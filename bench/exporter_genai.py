"""The onnxruntime-genai model builder as one of the ``exporters`` section's peers:
``python -m onnxruntime_genai.models.builder -p fp32 -e cpu`` (offline), and the feeds of its
graph's prefill and decode-step probes (a shared past/present buffer when its config says so)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from tfgraph.bench.exporter_probes import PREFILL, graph_inputs, kv_shape, node_count


def genai_peer(src: Path, kind: str, work: Path, precision: str = "fp32") -> dict:
    if importlib.util.find_spec("onnxruntime_genai") is None:
        raise ModuleNotFoundError(
            "onnxruntime-genai is not installed (pip install onnxruntime-genai)"
        )
    out = work / "genai"
    cmd = [
        sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(out),
        "-p", precision, "-e", "cpu", "-c", str(work / "genai-cache"),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    path = out / "model.onnx"
    if done.returncode or not path.is_file():
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if "Error:" in line]  # the raise, not the help text
        raise RuntimeError(((errors or lines) or ["builder failed"])[-1][:200])
    return genai_graphs(out)


def genai_graphs(out: Path) -> dict:
    """The prefill and decode-step probes of an onnxruntime-genai builder output in ``out``."""
    path = out / "model.onnx"
    config = json.loads((out / "genai_config.json").read_text())
    shared = bool(config.get("search", {}).get("past_present_share_buffer"))
    head_size = config["model"]["decoder"]["head_size"]

    def feeds(tokens: int, past: int) -> tuple[Path, dict, dict]:
        inputs, bind = {}, {}
        for name, dtype, dims in graph_inputs(path):
            if name == "input_ids":
                inputs[name] = {"shape": [1, tokens], "dtype": dtype, "high": 900}
            elif name == "attention_mask":
                inputs[name] = {"shape": [1, past + tokens], "dtype": dtype, "fill": "ones"}
            elif name == "position_ids":
                inputs[name] = {"shape": [1, tokens], "dtype": dtype, "fill": {"arange": past}}
            elif name.startswith("past_key_values."):
                length = past + tokens if shared else past
                inputs[name] = {"shape": kv_shape(dims, 1, length, head_size), "dtype": dtype}
                if shared:
                    bind[name.replace("past_key_values.", "present.")] = name
            else:
                raise RuntimeError(f"builder input '{name}' {dims} has no probe feed")
        return path, inputs, bind

    return {
        "nodes": node_count(path),
        "prefill": lambda: feeds(PREFILL, 0),
        "step": lambda p: feeds(1, p),
    }
