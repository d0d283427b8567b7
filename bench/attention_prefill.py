"""Prefill latency and peak memory of a causal decoder preset, attention fused vs unfused.

Exports ``llama-tiny`` (GQA 8:2, head size 8, RoPE) with the ``cleanup`` pipeline (attention
as traced: MatMul, Softmax over the n × n scores) and with ``default`` for the ``ort`` profile
(``com.microsoft.GroupQueryAttention``), then in a fresh process per configuration, without
torch (``ort_probe``): latency at 512 and 4096 (median of 5 after warm-up) and peak RSS of one
prefill at 8192.
Memory is reported as the process's peak RSS and as the run's extra RSS: the peak RSS of the
runs (VmHWM, reset through /proc/self/clear_refs once the session and inputs exist) minus the
RSS at that moment. The second is what the graph itself needs; the first includes the process
(Python, numpy, ONNX Runtime, the session's own peak while loading).

    python bench/attention_prefill.py [--out docs/bench/attention_prefill.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tfgraph.bench import shared
from tfgraph.bench.ort_probe import probe

PRESET = "llama-tiny"


def _probe(model: Path, seq: int, repeats: int) -> dict:
    """Latency and peak RSS in a fresh torch-free process (``ort_probe.probe``)."""
    inputs = {"input_ids": {"shape": [1, seq], "dtype": "int64", "high": 256}}
    return probe(model, inputs, repeats=repeats, threads=2)


def _extra(result: dict) -> float:
    """What the run itself added to the process's peak RSS (MiB); at least 1, to divide by."""
    return max(result["run_extra_rss_mib"], 1.0)


def run(quick: bool, workdir: Path, progress=lambda step: None) -> dict:
    """The ``attention_memory`` section; ``quick`` measures 512 only (both pipelines from one
    trace, which precision's quick exports of the preset reuse: :mod:`tfgraph.bench.shared`)."""
    with shared.scope(quick):
        return _run(quick, workdir, progress)


def _run(quick: bool, workdir: Path, progress) -> dict:
    plan = ((512, 3),) if quick else ((512, 5), (4096, 3), (8192, 1))
    results: dict = {"preset": PRESET, "threads": 2, "seqs": [s for s, _ in plan]}
    models = {}
    for pipeline in ("cleanup", "default"):
        progress(f"attention memory: export {pipeline}")
        result = shared.export(PRESET, workdir / f"attention-{pipeline}", pipeline=pipeline)
        assert result.passed
        models[pipeline] = workdir / f"attention-{pipeline}" / "model.onnx"
        results[f"{pipeline}_attention"] = {
            k: result.report["fusions"]["attention"][k] for k in ("fused", "total")
        }
    for seq, repeats in plan:
        progress(f"attention memory: {seq}")
        for pipeline, path in models.items():
            results[f"{pipeline}/{seq}"] = _probe(path, seq, repeats)
    for seq, _ in plan:
        unfused, fused = results[f"cleanup/{seq}"], results[f"default/{seq}"]
        results[f"ratio/{seq}"] = {
            "latency_unfused_over_fused": unfused["seconds"] / fused["seconds"],
            "peak_rss_fused_over_unfused": fused["peak_rss_mib"] / unfused["peak_rss_mib"],
            "run_extra_rss_fused_over_unfused": _extra(fused) / _extra(unfused),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("docs/bench/attention_prefill.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = run(False, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
