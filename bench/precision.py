"""Precision and weight formats on the CPU: decode and prefill, fp32 vs int8 vs int4 vs fp16.

For GPT-2-small (the zoo preset) and a ~120M Llama-shaped Hugging Face model (hidden 768, 12
layers, GQA 12:4, vocab 32000), each exported with the KV cache by tfgraph in every variant
(int8 and int4 at MatMulNBits accuracy level 4, the CPU default, and int4 at level 0),
and the same Llama built by the onnxruntime-genai model builder at int4 for the CPU
(``-p int4 -e cpu``). Every graph is timed by :func:`tfgraph.bench.ort_probe.probe` as the
``exporters`` section times them (fresh processes without torch, 2 threads, the fastest median
of three): **decode** — the mean step over a 128-token prompt plus 128 greedy tokens,
measured at pasts 128, 192 and 255 (a step's cost is linear in the past at these lengths) —
and **prefill** of 512 tokens. **Weight bytes** are the artifact's initializers; the
**bandwidth bound** is those bytes ÷ the machine's copy bandwidth: the least a decode step
reading every weight once can take. A quick run: the ``llama-tiny`` preset alone (its five
variants from one trace, :mod:`tfgraph.bench.shared`), the median of one process per timing.

    python -m tfgraph.bench.precision [--quick] [--out precision.json]
    (or as the ``precision`` section of ``python -m tfgraph bench``)
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tfgraph.bench import shared
from tfgraph.bench.exporter_genai import genai_peer
from tfgraph.bench.exporter_models import model_configs, save_model
from tfgraph.bench.exporter_probes import PREFILL, QUICK_TRIALS, TRIALS, failure_line, time_graph
from tfgraph.bench.exporter_tfgraph import tfgraph_peer

logger = logging.getLogger(__name__)

DECODE_PASTS = (128, 192, 255)  # a 128-token prompt, then 128 greedy tokens
VARIANTS = {
    "fp32": {},
    "int8": {"weights": "int8"},  # accuracy level 4, the CPU default: int8 activations
    "int4": {"weights": "int4"},
    "int4-level0": {"weights": "int4", "accuracy_level": 0},  # fp32 activations, exact parity
    "fp16": {"precision": "fp16"},
}


def _weight_bytes(directory: Path) -> int:
    import onnx

    model = onnx.load(str(directory / "model.onnx"), load_external_data=True)
    return sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def _timings(built: dict, repeats: int, trials: int = TRIALS) -> dict:
    steps = {str(p): time_graph(*built["step"](p), repeats, trials=trials) for p in DECODE_PASTS}
    return {
        "decode_step_seconds": statistics.mean(steps.values()),
        "step_seconds": steps,
        "prefill_seconds": time_graph(*built["prefill"](), repeats, trials=trials),
    }


def measure_model(
    name: str,
    src,
    root: Path,
    repeats: int,
    bandwidth: float,
    genai: bool,
    high,
    trials: int = TRIALS,
):
    row: dict = {"variants": {}}
    for variant, options in VARIANTS.items():
        work = root / f"{name}-{variant}"
        work.mkdir()
        try:
            built = tfgraph_peer(src, "causal", work, high=high, **options)
            entry = _timings(built, repeats, trials)
            entry["weight_bytes"] = _weight_bytes(work / "tfgraph")
        except Exception as exc:  # noqa: BLE001 - a variant that fails is a row
            row["variants"][variant] = {"error": failure_line(exc)}
            continue
        entry["bandwidth_bound_seconds"] = entry["weight_bytes"] / bandwidth
        entry["tokens_per_s"] = 1.0 / entry["decode_step_seconds"]
        row["variants"][variant] = entry
    if genai:
        work = root / f"{name}-genai-int4"
        work.mkdir()
        try:
            built = genai_peer(src, "causal", work, precision="int4")
            entry = _timings(built, repeats, trials)
            entry["weight_bytes"] = _weight_bytes(work / "genai")
            entry["bandwidth_bound_seconds"] = entry["weight_bytes"] / bandwidth
            entry["tokens_per_s"] = 1.0 / entry["decode_step_seconds"]
            row["genai_int4"] = entry
        except Exception as exc:  # noqa: BLE001 - recorded with its reason
            row["genai_int4"] = {"error": failure_line(exc)}
    fp32 = row["variants"].get("fp32", {})
    int4 = row["variants"].get("int4", {})
    if "tokens_per_s" in fp32 and "tokens_per_s" in int4:
        row["int4_over_fp32_tokens_per_s"] = int4["tokens_per_s"] / fp32["tokens_per_s"]
    if "tokens_per_s" in int4 and "tokens_per_s" in row.get("genai_int4", {}):
        row["int4_over_genai_int4_tokens_per_s"] = (
            int4["tokens_per_s"] / row["genai_int4"]["tokens_per_s"]
        )
    return row


def run(quick: bool, workdir: Path, progress=lambda step: None) -> dict:
    from tfgraph.bench.decode import copy_bandwidth
    from tfgraph.bench.exporters import _commit

    repeats = 3 if quick else 5
    trials = QUICK_TRIALS if quick else TRIALS
    bandwidth = copy_bandwidth()
    models: dict = {}
    if quick:
        plan = [("llama-tiny", "llama-tiny", False, 250)]
    else:
        config = model_configs(False)["llama-120m"][1]
        llama = save_model("llama-120m", "causal", config, workdir)
        plan = [("gpt2-small", "gpt2-small", False, 900), ("llama-120m", llama, True, 900)]
    with shared.scope(quick):  # a quick run's variants share one trace (attention_memory's)
        for name, src, genai, high in plan:
            progress(f"precision: {name}")
            models[name] = measure_model(
                name, src, workdir, repeats, bandwidth, genai, high, trials
            )
    return {
        "date": time.strftime("%Y-%m-%d"),
        "commit": _commit(),
        "threads": 2,
        "trials": trials,
        "prefill_tokens": PREFILL,
        "decode_pasts": list(DECODE_PASTS),
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "models": models,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="precision.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="tfgraph-precision-") as tmp:
        data = run(args.quick, Path(tmp), lambda s: print(s, file=sys.stderr))
    Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
