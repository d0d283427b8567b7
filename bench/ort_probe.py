"""Run one ONNX Runtime configuration in a fresh process that never imports torch.

KERNELS.md: with torch's and ORT's thread pools in one process on 2 cores, ORT latency was
inflated about 3×; and a fresh process per configuration gives each its own peak RSS.
:func:`probe` starts ``python -m tfgraph.bench.ort_probe`` and returns what it measured:

- ``seconds``: median of ``repeats`` runs after one warm-up (a single run when ``repeats`` is 1);
- ``peak_rss_mib``: the process's peak RSS (VmHWM) over session load and runs;
- ``run_extra_rss_mib``: the runs' peak RSS minus the RSS before them (VmHWM is reset through
  ``/proc/self/clear_refs`` once the session and inputs exist): what the graph itself needs.

Inputs are described as ``{name: {"shape": [...], "dtype": "int64", "high": N}}`` (random
integers in [1, high) for integer inputs, ones for names containing ``mask``, standard normal
for floats); ``"fill"`` overrides that: ``"ones"``, ``"zeros"``, ``{"value": v}`` or
``{"arange": start}`` (along the last axis: position ids). ``bind`` (``{output: input}``)
writes those outputs into their inputs' buffers through an IOBinding, as a runtime with a
shared past/present KV buffer does; the other outputs are allocated by ONNX Runtime.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def probe(
    model: str | Path,
    inputs: dict[str, dict],
    *,
    repeats: int = 5,
    threads: int = 2,
    optimize: bool = True,
    timeout: float = 1800,
    bind: dict[str, str] | None = None,
) -> dict:
    spec = json.dumps(
        {
            "inputs": inputs,
            "repeats": repeats,
            "threads": threads,
            "optimize": optimize,
            "bind": bind or {},
        }
    )
    out = subprocess.run(
        [sys.executable, "-m", "tfgraph.bench.ort_probe", str(model), spec],
        check=True,
        capture_output=True,
        text=True,
        timeout=timeout,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _status(key: str) -> float:
    """A /proc/self/status entry in MiB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def _main(model: str, spec: dict) -> dict:
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = spec["threads"]
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if not spec["optimize"]:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model,
        options,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=["SkipLayerNormFusion"],
    )
    rng = np.random.default_rng(0)
    feeds = {name: _feed(name, desc, rng) for name, desc in spec["inputs"].items()}
    bind = spec.get("bind") or {}
    if not bind:
        return measure(lambda: session.run(None, feeds), spec["repeats"])
    binding = session.io_binding()
    for name, array in feeds.items():
        value = ort.OrtValue.ortvalue_from_numpy(array)
        feeds[name] = value  # kept alive: the binding refers to it
        binding.bind_ortvalue_input(name, value)
    for out in session.get_outputs():
        if out.name in bind:
            binding.bind_ortvalue_output(out.name, feeds[bind[out.name]])
        else:
            binding.bind_output(out.name)
    return measure(lambda: session.run_with_iobinding(binding), spec["repeats"])


def _feed(name: str, desc: dict, rng):
    import numpy as np

    dtype = np.dtype(desc.get("dtype", "int64"))
    shape = desc["shape"]
    fill = desc.get("fill")
    if fill == "ones" or (fill is None and "mask" in name):
        return np.ones(shape, dtype)
    if fill == "zeros":
        return np.zeros(shape, dtype)
    if isinstance(fill, dict) and "value" in fill:
        return np.full(shape, fill["value"], dtype)
    if isinstance(fill, dict) and "arange" in fill:
        start = fill["arange"]
        return np.broadcast_to(np.arange(start, start + shape[-1]), shape).astype(dtype).copy()
    if dtype.kind in "iu":
        return rng.integers(1, desc.get("high", 256), shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def measure(run, repeats: int) -> dict:
    """Time ``run()`` (median of ``repeats`` after one warm-up, or one run) and the peak RSS:
    VmHWM is reset once everything is loaded, so ``run_extra_rss_mib`` is the runs' own."""
    import statistics
    import time

    load_peak = _status("VmHWM")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    times = []
    for _ in range(repeats + (1 if repeats > 1 else 0)):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    run_peak = _status("VmHWM")
    return {
        "seconds": statistics.median(times[1:] if repeats > 1 else times),
        "peak_rss_mib": max(run_peak, load_peak),
        "run_extra_rss_mib": run_peak - before,
        "rss_before_run_mib": before,
    }


if __name__ == "__main__":
    print(json.dumps(_main(sys.argv[1], json.loads(sys.argv[2]))))
