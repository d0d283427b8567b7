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

The pieces, one module each: the models (:mod:`~tfgraph.bench.exporter_models`), how a graph
is fed and timed (:mod:`~tfgraph.bench.exporter_probes`), the peers
(:mod:`~tfgraph.bench.exporter_tfgraph`, :mod:`~tfgraph.bench.exporter_genai`,
:mod:`~tfgraph.bench.exporter_hf`); this module runs them and writes the result.

    python -m tfgraph.bench.exporters [--quick] [--out exporters.json]
    (or as the ``exporters`` section of ``python -m tfgraph bench``)
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tfgraph.bench.exporter_genai import genai_peer
from tfgraph.bench.exporter_hf import optimum_peer, transformers_peer
from tfgraph.bench.exporter_models import QUICK_TINY, TINY, model_configs, save_model
from tfgraph.bench.exporter_probes import (
    ENCODER_LENGTH,
    PASTS,
    PREFILL,
    QUICK_TRIALS,
    THREADS,
    TRIALS,
    failure_line,
    time_graph,
    time_graphs,
)
from tfgraph.bench.exporter_tfgraph import tfgraph_peer

logger = logging.getLogger(__name__)

PEERS = ("tfgraph", "tfgraph_static", "transformers", "genai_builder", "optimum")

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
            entry["prefill_seconds"] = time_graphs(built["prefill"](), repeats, trials)
            for past in PASTS:
                step = built["step"](past)
                entry["step_seconds"][str(past)] = time_graph(*step, repeats * 4, trials=trials)
        except Exception as exc:  # noqa: BLE001 - recorded; the other peers still run
            entry["error"] = failure_line(exc)
        steps = entry["step_seconds"]
        if "128" in steps and "1016" in steps:
            entry["step_1016_over_128"] = steps["1016"] / steps["128"]
        row["peers"][peer] = entry
    _ratios(row)
    return row


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
            steps = {str(p): time_graph(*built["step"](p), repeats * 4) for p in PASTS}
            ends = (str(PASTS[0]), str(PASTS[-1]))
            kernels = {p: time_graph(*built["step"](int(p)), repeats * 4, True) for p in ends}
        except Exception as exc:  # noqa: BLE001 - recorded as the row
            rows[preset] = {"error": failure_line(exc)}
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
