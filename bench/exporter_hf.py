"""Hugging Face's exporters as peers of the ``exporters`` section: transformers' own
``OnnxExporter`` and Optimum's ``optimum-cli export onnx`` (both grow the cache by ``Concat``),
and the feeds of their prefill and decode-step probes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tfgraph.bench.exporter_probes import (
    ENCODER_LENGTH,
    PREFILL,
    graph_inputs,
    kv_shape,
    node_count,
)

# optimum-onnx pins transformers < 4.58: it runs from its own environment when this names one
OPTIMUM_PYTHON_ENV = "TFGRAPH_OPTIMUM_PYTHON"


def transformers_peer(src: Path, kind: str, work: Path) -> dict:
    import torch
    import transformers as T
    from transformers.exporters.exporter_onnx import OnnxConfig, OnnxExporter

    out = work / "transformers"
    cls = T.AutoModelForSeq2SeqLM if kind == "seq2seq" else T.AutoModelForCausalLM
    model = cls.from_pretrained(src).eval()
    ids = torch.randint(3, 900, (1, 16))
    exported = OnnxExporter().export_for_generation(
        model,
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        OnnxConfig(dynamic=True, ort_fusions="cpu"),
    )
    exported.save_pretrained(out)
    graphs = {p.stem: p for p in out.glob("*.onnx")}
    if "decode" not in graphs:
        raise RuntimeError(f"no decode graph among {sorted(graphs)}")
    decode = graphs["decode"]

    def feeds(path: Path, tokens: int, past: int) -> tuple[Path, dict, dict]:
        inputs = {}
        for name, dtype, dims in graph_inputs(path):
            if name in ("input_ids", "decoder_input_ids"):
                length = (
                    PREFILL
                    if (kind == "seq2seq" and path != decode and name == "input_ids")
                    else tokens
                )
                inputs[name] = {"shape": [1, length], "dtype": dtype, "high": 900}
            elif name == "position_ids" or name == "cache_position":
                shape = [1, tokens] if len(dims) == 2 else [tokens]
                inputs[name] = {"shape": shape, "dtype": dtype, "fill": {"arange": past}}
            elif "mask" in name:
                length = ENCODER_LENGTH if kind == "seq2seq" else past + tokens
                inputs[name] = {"shape": [1, length], "dtype": dtype, "fill": "ones"}
            elif name.endswith("_sliding_window_tensor"):  # Mistral's window, a scalar
                window = getattr(model.config, "sliding_window", None) or 4096
                inputs[name] = {"shape": [], "dtype": dtype, "fill": {"value": window}}
            elif "cache" in name and len(dims) == 4:
                cross = "cross" in name or "encoder" in name
                if not cross and path == decode and isinstance(dims[2], int):
                    raise RuntimeError(
                        f"its decode graph fixes the self-attention cache length at {dims[2]} "
                        f"('{name}'): no decode step at a longer past"
                    )
                inputs[name] = {
                    "shape": kv_shape(dims, 1, ENCODER_LENGTH if cross else past),
                    "dtype": dtype,
                }
            elif dtype.startswith("float") and len(dims) == 3:  # encoder hidden states
                inputs[name] = {"shape": [1, ENCODER_LENGTH, dims[2]], "dtype": dtype}
            else:
                raise RuntimeError(f"transformers' input '{name}' {dims} has no probe feed")
        return path, inputs, {}

    if kind == "seq2seq" and "encoder" not in graphs:
        raise RuntimeError(
            f"no encoder graph among {sorted(graphs)} (its prefill takes the encoder's output)"
        )
    first = graphs.get("encoder") if kind == "seq2seq" else graphs.get("prefill")
    if first is None:
        raise RuntimeError(f"no prefill graph among {sorted(graphs)}")
    return {
        "nodes": node_count(decode),
        "prefill": lambda: feeds(first, PREFILL, 0),
        "step": lambda p: feeds(decode, 1, p),
        "graphs": sorted(graphs),
    }


def _optimum_python() -> str:
    python = os.environ.get(OPTIMUM_PYTHON_ENV, sys.executable)
    check = subprocess.run(
        [python, "-c", "import optimum.exporters.onnx"], capture_output=True, text=True
    )
    if check.returncode:
        last = ([line for line in check.stderr.splitlines() if line.strip()] or ["?"])[-1]
        raise ModuleNotFoundError(
            f"optimum-onnx does not import ({last[:120]}); it needs transformers < 4.58: "
            f"set {OPTIMUM_PYTHON_ENV} to a Python that has it"
        )
    return python


def optimum_peer(src: Path, kind: str, work: Path) -> dict:
    """Hugging Face Optimum's ONNX export (``optimum-cli export onnx --task …-with-past``),
    no ORT optimizer pass: ``encoder_model.onnx`` + ``decoder_with_past_model.onnx`` for T5,
    one ``model.onnx`` with past inputs for decoders (the cache grows by ``Concat``)."""
    python = _optimum_python()
    out = work / "optimum"
    task = "text2text-generation-with-past" if kind == "seq2seq" else "text-generation-with-past"
    cmd = [
        python, "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", str(src),
        "--task", task, str(out),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line]
        raise RuntimeError(((errors or lines) or ["export failed"])[-1][:200])
    step = out / ("decoder_with_past_model.onnx" if kind == "seq2seq" else "model.onnx")
    if not step.is_file():
        raise RuntimeError(f"no {step.name} among {sorted(p.name for p in out.glob('*.onnx'))}")

    def feeds(path: Path, tokens: int, past: int) -> tuple[Path, dict, dict]:
        inputs = {}
        for name, dtype, dims in graph_inputs(path):
            if name in ("input_ids", "decoder_input_ids"):
                length = PREFILL if path.name == "encoder_model.onnx" else tokens
                inputs[name] = {"shape": [1, length], "dtype": dtype, "high": 900}
            elif name == "encoder_attention_mask" or (
                name == "attention_mask" and kind == "seq2seq"
            ):
                inputs[name] = {"shape": [1, ENCODER_LENGTH], "dtype": dtype, "fill": "ones"}
            elif name == "attention_mask":
                inputs[name] = {"shape": [1, past + tokens], "dtype": dtype, "fill": "ones"}
            elif name == "position_ids":
                inputs[name] = {"shape": [1, tokens], "dtype": dtype, "fill": {"arange": past}}
            elif name.startswith("past_key_values."):
                cross = ".encoder." in name
                length = ENCODER_LENGTH if cross else past
                inputs[name] = {"shape": kv_shape(dims, 1, length), "dtype": dtype}
            elif name == "encoder_hidden_states":
                inputs[name] = {"shape": [1, ENCODER_LENGTH, int(dims[2])], "dtype": dtype}
            else:
                raise RuntimeError(f"optimum's input '{name}' {dims} has no probe feed")
        return path, inputs, {}

    def prefill():
        if kind == "seq2seq":  # the encoder, then the first step (it projects the cross K/V)
            return [feeds(out / "encoder_model.onnx", PREFILL, 0),
                    feeds(out / "decoder_model.onnx", 1, 0)]  # fmt: skip
        return feeds(step, PREFILL, 0)

    return {
        "nodes": node_count(step),
        "prefill": prefill,
        "step": lambda p: feeds(step, 1, p),
    }
