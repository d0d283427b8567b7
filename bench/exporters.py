"""tfgraph's cached decoders against the exporters a user would pick instead, in one run.

The same random-init Hugging Face models (saved with ``save_pretrained`` and a word-level
tokenizer, nothing downloaded) go through each exporter that supports them:

- ``tfgraph``: ``tfgraph.export(DIR, kv_cache=True)`` for the ``ort`` target (one graph for
  prefill and decode, a shared past/present KV buffer, ``encoder.onnx`` for T5);
- ``transformers``: transformers' own ``OnnxExporter().export_for_generation`` with
  ``OnnxConfig(dynamic=True, ort_fusions="cpu")`` (a ``prefill`` and a ``decode`` graph; the
  cache grows by ``Concat``);
- ``genai_builder``: the onnxruntime-genai model builder,
  ``python -m onnxruntime_genai.models.builder -i DIR -o OUT -p fp32 -e cpu`` (offline; a
  shared KV buffer, RoPE inside ``GroupQueryAttention``, packed QKV);
- ``optimum``: Hugging Face Optimum, ``optimum-cli export onnx --task …-with-past`` (the cache
  grows by ``Concat``). optimum-onnx pins transformers < 4.58, so it runs from the Python that
  ``TFGRAPH_OPTIMUM_PYTHON`` names (a venv with ``optimum-onnx`` and transformers 4.57).

Each graph is timed by :func:`tfgraph.bench.ort_probe.probe`, in a fresh process that never
imports torch (the fastest median of three such processes), batch 1, the same threads for
all: prefill of 512 tokens, and one decode step (one token) on a cache holding 128, 512 and
1016 positions (a T5 step attends to a 512-token encoder output; a T5 prefill is the encoder
plus the first decoder step, where Optimum's graphs project the cross K/V and tfgraph's
encoder does). Shared-buffer graphs are fed a buffer of past + 1 positions and write the new
row in place (``bind``), as their runtimes do; ``Concat`` graphs get a past of exactly that
length. Node counts are those of the decode graph as written. A peer that is not installed,
or that does not support an architecture, is recorded with its reason, not left out silently.
Tfgraph's own zoo decoders (:data:`ZOO`) are timed at the same pasts. A quick run: the Llama
alone, one layer (:data:`QUICK_TINY`), one process per timing (:data:`QUICK_TRIALS`), no zoo.

    python -m tfgraph.bench.exporters [--quick] [--out exporters.json]
    (or as the ``exporters`` section of ``python -m tfgraph bench``)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tfgraph.bench.ort_probe import probe

logger = logging.getLogger(__name__)

THREADS = 2
PREFILL = 512
PASTS = (128, 512, 1016)
ENCODER_LENGTH = 512
PEERS = ("tfgraph", "tfgraph_static", "transformers", "genai_builder", "optimum")
STATIC_CAPACITY = max(PASTS) + 8  # a static cache's buffers: the generation's capacity
# optimum-onnx pins transformers < 4.58: it runs from its own environment when this names one
OPTIMUM_PYTHON_ENV = "TFGRAPH_OPTIMUM_PYTHON"
TINY = {"vocab": 1000, "hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "ffn": 512}
# a quick run's llama: 1 layer (tracing, by each exporter, is most of the section's time);
# the vocab stays 1000: the probes draw token ids below 900
QUICK_TINY = {**TINY, "layers": 1}
QUICK_TRIALS = 1  # a quick run's fresh processes per measurement


def model_configs(quick: bool) -> dict[str, tuple[str, object]]:
    """name → (kind, transformers config): the models every peer is tried on (``quick``: the
    llama alone, :data:`QUICK_TINY`'s size)."""
    import transformers as T

    t = QUICK_TINY if quick else TINY
    common = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    llama = {
        "vocab_size": t["vocab"],
        "hidden_size": t["hidden"],
        "intermediate_size": t["ffn"],
        "num_hidden_layers": t["layers"],
        "num_attention_heads": t["heads"],
        "num_key_value_heads": t["kv_heads"],
        "max_position_embeddings": 2048,
        **common,
    }
    configs = {
        "llama": ("causal", T.LlamaConfig(**llama)),
        "mistral": ("causal", T.MistralConfig(**llama, sliding_window=4096)),
        "gpt2": (
            "causal",
            T.GPT2Config(
                vocab_size=t["vocab"],
                n_embd=t["hidden"],
                n_layer=t["layers"],
                n_head=t["heads"],
                n_positions=2048,
                **common,
            ),
        ),
        "bloom": (
            "causal",
            T.BloomConfig(
                vocab_size=t["vocab"],
                hidden_size=t["hidden"],
                n_layer=t["layers"],
                n_head=t["heads"],
                **common,
            ),
        ),  # fmt: skip
        "t5": (
            "seq2seq",
            T.T5Config(
                vocab_size=t["vocab"],
                d_model=t["hidden"],
                d_ff=t["ffn"],
                d_kv=32,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=t["heads"],
                decoder_start_token_id=0,
                **common,
            ),
        ),  # fmt: skip
    }
    if quick:
        return {k: configs[k] for k in ("llama",)}
    configs["llama-120m"] = (
        "causal",
        T.LlamaConfig(
            **{
                **llama,
                "vocab_size": 32000,
                "hidden_size": 768,
                "intermediate_size": 2048,
                "num_hidden_layers": 12,
                "num_attention_heads": 12,
                "num_key_value_heads": 4,
            }
        ),
    )
    return configs


def save_model(name: str, kind: str, config, root: Path) -> Path:
    """A random-init checkpoint and a word-level tokenizer (the builder needs one)."""
    import torch
    import transformers as T

    out = root / name
    torch.manual_seed(0)
    cls = T.AutoModelForSeq2SeqLM if kind == "seq2seq" else T.AutoModelForCausalLM
    model = cls.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(out)
    save_tokenizer(config.vocab_size, out)
    return out


def save_tokenizer(vocab_size: int, out: Path) -> None:
    """A word-level tokenizer over ``vocab_size`` ids (``t0``, ``t1``, …) beside a checkpoint."""
    import transformers as T
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    T.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t0"
    ).save_pretrained(out)


# --- graphs and their inputs --------------------------------------------------------------------


def graph_inputs(path: Path) -> list[tuple[str, str, list]]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    types = {1: "float32", 7: "int64", 6: "int32", 10: "float16"}
    return [
        (
            i.name,
            types.get(i.type.tensor_type.elem_type, "float32"),
            [
                d.dim_value if d.HasField("dim_value") else d.dim_param
                for d in i.type.tensor_type.shape.dim
            ],
        )
        for i in model.graph.input
    ]


def node_count(path: Path) -> int:
    import onnx

    return len(onnx.load(str(path), load_external_data=False).graph.node)


def _kv(dims: list, batch: int, length: int, head_size: int | None = None) -> list[int]:
    """A KV tensor's shape; transformers' exporter writes static head dims as dim params
    ("4"), the builder leaves the head size symbolic (its config states it)."""
    size = head_size if head_size is not None else int(dims[3])
    return [batch, int(dims[1]), length, size]


TRIALS = 3  # fresh processes per measurement; the fastest median is kept


def _time(
    path: Path,
    inputs: dict,
    bind: dict | None,
    repeats: int,
    kernels_only: bool = False,
    trials: int = TRIALS,
) -> float:
    """The lowest of ``trials`` (:data:`TRIALS`) medians, each from a fresh process: on these
    shared machines one process's median moved ±25% between identical runs (measured).
    ``kernels_only``: the graph's attention kernels alone, on the inputs the graph gave them."""
    return min(
        probe(path, inputs, repeats=repeats, threads=THREADS, bind=bind, kernels_only=kernels_only)[
            "seconds"
        ]
        for _ in range(trials)
    )


# --- the peers ------------------------------------------------------------------------------------


def _time_all(graphs, repeats: int, trials: int = TRIALS) -> float:
    """One graph's time, or the sum over a list of them (a T5 prefill: encoder + first step)."""
    if isinstance(graphs, tuple):
        return _time(*graphs, repeats, trials=trials)
    return sum(_time(*g, repeats, trials=trials) for g in graphs)


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
                inputs[name] = {"shape": _kv(dims, 1, length), "dtype": dtype}
            elif role in ("cross_key", "cross_value"):
                inputs[name] = {"shape": _kv(dims, 1, ENCODER_LENGTH), "dtype": dtype}
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
                    "shape": _kv(dims, 1, ENCODER_LENGTH if cross else past),
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
                inputs[name] = {"shape": _kv(dims, 1, length, head_size), "dtype": dtype}
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
                inputs[name] = {"shape": _kv(dims, 1, length), "dtype": dtype}
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


PEER_BUILDERS: dict[str, Callable[[Path, str, Path], dict]] = {
    "tfgraph": tfgraph_peer,
    # the onnx target's static standard-ONNX cache (TensorScatter-24, Attention over the buffer)
    "tfgraph_static": lambda src, kind, work: tfgraph_peer(src, kind, work, target="onnx"),
    "transformers": transformers_peer,
    "genai_builder": genai_peer,
    "optimum": optimum_peer,
}


# --- the run --------------------------------------------------------------------------------------


def measure_model(
    name: str, kind: str, config, root: Path, repeats: int, progress, trials: int = TRIALS
) -> dict:
    src = save_model(name, kind, config, root)
    row: dict = {"kind": kind, "peers": {}}
    for peer in PEERS:
        work = root / f"{name}-{peer}"
        work.mkdir()
        progress(f"exporters: {name} / {peer}")
        entry: dict = {}
        try:
            built = PEER_BUILDERS[peer](src, kind, work)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot export is a row
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            entry = {"available": False, "note": f"{type(exc).__name__}: {first}"}
            row["peers"][peer] = entry
            continue
        entry = {"available": True, "nodes": built["nodes"], "step_seconds": {}}
        try:
            entry["prefill_seconds"] = _time_all(built["prefill"](), repeats, trials)
            for past in PASTS:
                step = built["step"](past)
                entry["step_seconds"][str(past)] = _time(*step, repeats * 4, trials=trials)
        except Exception as exc:  # noqa: BLE001 - recorded; the other peers still run
            entry["error"] = _failure(exc)
        steps = entry["step_seconds"]
        if "128" in steps and "1016" in steps:
            entry["step_1016_over_128"] = steps["1016"] / steps["128"]
        row["peers"][peer] = entry
    _ratios(row)
    return row


def _failure(exc: Exception) -> str:
    """One line: a probe's own last stderr line rather than its command line."""
    if isinstance(exc, subprocess.CalledProcessError):
        tail = [line for line in (exc.stderr or "").splitlines() if line.strip()][-1:] or [""]
        return f"probe exit status {exc.returncode}: {tail[0][:300]}"
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


def _ratios(row: dict) -> None:
    """tfgraph against the best other peer, per measurement (lower is better for tfgraph)."""
    ours = row["peers"].get("tfgraph", {})
    others = {
        p: e
        for p, e in row["peers"].items()
        if not p.startswith("tfgraph") and e.get("available") and "error" not in e
    }
    if not ours.get("available") or "error" in ours or not others:
        return
    best_step = min(others, key=lambda p: others[p]["step_seconds"].get("512", float("inf")))
    best_prefill = min(others, key=lambda p: others[p].get("prefill_seconds", float("inf")))
    row["best_peer_step"] = best_step
    row["step_512_vs_best"] = ours["step_seconds"]["512"] / others[best_step]["step_seconds"]["512"]
    row["best_peer_prefill"] = best_prefill
    row["prefill_vs_best"] = ours["prefill_seconds"] / others[best_prefill]["prefill_seconds"]


# zoo decoders whose positions extend past their declared 128 (RoPE, ALiBi, relative biases);
# the probe runs their graphs at the same pasts as the Hugging Face models
ZOO = {
    "llama-tiny": "causal",
    "mistral-tiny": "causal",
    "bloom-tiny": "causal",
    "mpt-tiny": "causal",
    "shaw-tiny": "causal",
    "t5-tiny": "seq2seq",
}


def measure_zoo(root: Path, repeats: int, progress) -> dict:
    """tfgraph's decode step per zoo decoder and encoder-decoder at :data:`PASTS`, and its
    attention kernels alone at the shortest and longest past: ``kernel_floor`` is the
    1016 / 128 ratio the step would have if nothing but the kernels grew."""
    rows = {}
    for preset, kind in ZOO.items():
        progress(f"exporters: zoo {preset}")
        work = root / f"zoo-{preset}"
        work.mkdir()
        try:
            built = tfgraph_peer(preset, kind, work, high=250)  # the zoo's vocab is 256
            steps = {str(p): _time(*built["step"](p), repeats * 4) for p in PASTS}
            ends = (str(PASTS[0]), str(PASTS[-1]))
            kernels = {p: _time(*built["step"](int(p)), repeats * 4, True) for p in ends}
        except Exception as exc:  # noqa: BLE001 - recorded as the row
            rows[preset] = {"error": _failure(exc)}
            continue
        rows[preset] = {
            "nodes": built["nodes"],
            "step_seconds": steps,
            "step_1016_over_128": steps[ends[1]] / steps[ends[0]],
            "kernel_seconds": kernels,
            "kernel_floor": (steps[ends[0]] + kernels[ends[1]] - kernels[ends[0]]) / steps[ends[0]],
        }
    return rows


def _commit() -> str | None:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent,
    )
    return done.stdout.strip() or None if done.returncode == 0 else None


def run(quick: bool, workdir: Path, progress=lambda step: None, only=None) -> dict:
    """Every model of :func:`model_configs` through every peer, and the zoo (full runs). A
    quick run: the llama alone at :data:`QUICK_TINY`'s size, :data:`QUICK_TRIALS` process per
    measurement, no zoo."""
    from tfgraph.bench import shared

    repeats = 3 if quick else 5
    trials = QUICK_TRIALS if quick else TRIALS
    models = {}
    small = quick and not only
    configs = model_configs(small)
    with shared.scope(quick):
        for name, (kind, config) in configs.items():
            if only and name not in only:
                continue
            models[name] = measure_model(name, kind, config, workdir, repeats, progress, trials)
    zoo = {} if quick or only else measure_zoo(workdir, repeats, progress)
    return {
        "zoo": zoo,
        "date": time.strftime("%Y-%m-%d"),
        "commit": _commit(),
        "threads": THREADS,
        "trials": trials,
        "prefill_tokens": PREFILL,
        "pasts": list(PASTS),
        "encoder_length": ENCODER_LENGTH,
        "tiny": QUICK_TINY if small else TINY,
        "models": models,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="exporters.json")
    parser.add_argument("--only", help="comma-separated model names")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    only = args.only.split(",") if args.only else None
    with tempfile.TemporaryDirectory(prefix="tfgraph-exporters-") as tmp:
        data = run(args.quick, Path(tmp), lambda s: print(s, file=sys.stderr), only=only)
    Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
