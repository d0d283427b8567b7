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

``kernels_only`` times the graph's attention kernels alone (:func:`attention_kernels`): one
run of the whole graph captures their inputs, then a graph holding only those nodes is timed on
them, bound the same way. What a step costs beyond them is the rest of the graph; how they grow
with the past is the least any graph built on those kernels can grow.
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
    kernels_only: bool = False,
) -> dict:
    spec = json.dumps(
        {
            "inputs": inputs,
            "repeats": repeats,
            "threads": threads,
            "optimize": optimize,
            "bind": bind or {},
            "kernels_only": kernels_only,
            **({"kernels": sorted(attention_kernels())} if kernels_only else {}),
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


def attention_kernels() -> set[tuple[str, str]]:
    """The attention kernels ``kernels_only`` keeps, as (domain, op type): ONNX Runtime's
    (their names from the ``ort`` target, :mod:`tfgraph.exporters.ort.ops`) and ONNX's own
    ``Attention``. Imported on demand: the fresh probe process gets them in its spec, so it
    never loads the exporters (their import would add to the RSS it measures)."""
    from tfgraph.exporters.ort import ops

    return {
        (ops.MS_DOMAIN, ops.GROUP_QUERY_ATTENTION),
        (ops.MS_DOMAIN, ops.MULTI_HEAD_ATTENTION),
        (ops.MS_DOMAIN, ops.ATTENTION),
        ("", "Attention"),  # the standard ONNX op (opset 23)
    }


def _session(model, spec: dict):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = spec["threads"]
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if not spec["optimize"]:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(
        model,
        options,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=["SkipLayerNormFusion"],
    )


def _runner(session, feeds: dict, bind: dict):
    """A no-argument callable running ``session`` on ``feeds``; outputs named in ``bind``
    write into their inputs' buffers through an IOBinding."""
    import onnxruntime as ort

    bind = {o: i for o, i in bind.items() if o in {x.name for x in session.get_outputs()}}
    if not bind:
        return lambda: session.run(None, feeds)
    binding = session.io_binding()
    values = {}
    for name, array in feeds.items():
        values[name] = ort.OrtValue.ortvalue_from_numpy(array)  # kept alive by the closure
        binding.bind_ortvalue_input(name, values[name])
    for out in session.get_outputs():
        if out.name in bind:
            binding.bind_ortvalue_output(out.name, values[bind[out.name]])
        else:
            binding.bind_output(out.name)
    return lambda: (values, session.run_with_iobinding(binding))


def _kernels_alone(model: str, spec: dict, feeds: dict):
    """(a session of the kernel nodes alone, their feeds): their inputs that the graph
    computes are captured from one run of the whole graph."""
    import onnx
    from onnx.utils import Extractor

    proto = onnx.load(model)
    graph = proto.graph
    wanted = {tuple(k) for k in spec["kernels"]} if "kernels" in spec else attention_kernels()
    kernels = [n for n in graph.node if (n.domain or "", n.op_type) in wanted]
    if not kernels:
        raise SystemExit(f"{model}: no attention kernel to time alone")
    constants = {i.name for i in graph.initializer}
    needed = list(dict.fromkeys(i for n in kernels for i in n.input if i and i not in constants))
    computed = [name for name in needed if name not in feeds]
    infos = {v.name: v for v in graph.value_info}
    capture = onnx.ModelProto()
    capture.CopyFrom(proto)
    capture.graph.output.extend(infos[name] for name in computed)
    session = _session(capture.SerializeToString(), spec)
    names = [o.name for o in session.get_outputs()]
    values = dict(zip(names, session.run(None, feeds), strict=True))
    alone = Extractor(proto).extract_model(needed, [o for n in kernels for o in n.output if o])
    sub_feeds = {name: feeds[name] if name in feeds else values[name] for name in needed}
    return _session(alone.SerializeToString(), spec), sub_feeds


def _main(model: str, spec: dict) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    feeds = {name: _feed(name, desc, rng) for name, desc in spec["inputs"].items()}
    if spec.get("kernels_only"):
        session, feeds = _kernels_alone(model, spec, feeds)
    else:
        session = _session(model, spec)
    return measure(_runner(session, feeds, spec.get("bind") or {}), spec["repeats"])


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
