"""Prefill latency and peak memory of a causal decoder preset, attention fused vs unfused.

Exports ``llama-tiny`` (GQA 8:2, head size 8, RoPE) with the ``cleanup`` pipeline (attention
as traced: MatMul, Softmax over the n × n scores) and with ``default`` for the ``ort`` profile
(``com.microsoft.GroupQueryAttention``), then in a fresh process per configuration, without
torch: latency at 512 and 4096 (median of 5 after warm-up) and peak RSS of one prefill at 8192.

    python bench/attention_prefill.py [--out docs/bench/attention_prefill.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import tfgraph

PRESET = "llama-tiny"
PROBE = r"""
import json, resource, statistics, sys, time
import numpy as np, onnxruntime as ort
path, seq, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.inter_op_num_threads = 1
s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"],
                         disabled_optimizers=["SkipLayerNormFusion"])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ids = np.random.default_rng(0).integers(0, 256, (1, seq), dtype=np.int64)
times = []
for i in range(repeats + (1 if repeats > 1 else 0)):
    t = time.perf_counter(); s.run(None, {"input_ids": ids}); times.append(time.perf_counter() - t)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": statistics.median(times[1:] if repeats > 1 else times),
                  "peak_rss_mib": peak / 1024, "rss_before_run_mib": before / 1024}))
"""


def _probe(model: Path, seq: int, repeats: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(model), str(seq), str(repeats)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("docs/bench/attention_prefill.json"))
    args = parser.parse_args()
    results: dict = {"preset": PRESET, "threads": 2}
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for pipeline in ("cleanup", "default"):
            result = tfgraph.export(PRESET, Path(tmp) / pipeline, pipeline=pipeline)
            assert result.passed
            models[pipeline] = Path(tmp) / pipeline / "model.onnx"
            results[f"{pipeline}_attention"] = {
                k: result.report["fusions"]["attention"][k] for k in ("fused", "total")
            }
        for seq, repeats in ((512, 5), (4096, 3), (8192, 1)):
            for pipeline, path in models.items():
                results[f"{pipeline}/{seq}"] = _probe(path, seq, repeats)
    for seq in (512, 4096, 8192):
        unfused, fused = results[f"cleanup/{seq}"], results[f"default/{seq}"]
        results[f"ratio/{seq}"] = {
            "latency_unfused_over_fused": unfused["seconds"] / fused["seconds"],
            "peak_rss_fused_over_unfused": fused["peak_rss_mib"] / unfused["peak_rss_mib"],
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
