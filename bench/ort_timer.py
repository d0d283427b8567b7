"""Time ONNX Runtime prefill in a process that never imports torch (KERNELS.md: both thread
pools in one process inflated ORT latency about 3× on 2 cores).

Usage: python bench/ort_timer.py MODEL.onnx SEQ [SEQ ...] --threads N --opt all|none
Prints one JSON line: {"seq": median seconds, ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import onnxruntime as ort


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("seqs", type=int, nargs="+")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--opt", choices=["all", "none"], default="all")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=256)
    args = parser.parse_args()
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.inter_op_num_threads = 1
    if args.opt == "none":
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # For every engine alike: ORT's SkipLayerNormFusion makes a slower kernel on the CPU
    # (tfgraph's ort graphs never let it fire; peers' graphs would).
    session = ort.InferenceSession(
        args.model,
        options,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=["SkipLayerNormFusion"],
    )
    rng = np.random.default_rng(0)
    results = {}
    for seq in args.seqs:
        feeds = {"input_ids": rng.integers(0, args.vocab, (1, seq), dtype=np.int64)}
        for _ in range(3):
            session.run(None, feeds)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            session.run(None, feeds)
            times.append(time.perf_counter() - start)
        results[seq] = statistics.median(times)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
