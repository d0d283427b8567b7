"""``python -m tfgraph bench [--quick] [--out DIR]``: every benchmark section in one run.

Sections (each a module of :mod:`tfgraph.bench` with ``run(quick, workdir, ...)``):
``prefill`` (latency and memory against sequence length: eager, unfused, each profile),
``attention_memory`` (fused vs unfused attention at 8192), ``decode`` (tokens/s and time per
token against past length, vs eager and Hugging Face ``generate``), ``compile_cost`` (export time
against layers), ``peers`` (ONNX Runtime's transformers optimizer, onnxscript's
``optimize_for_ort``), ``exporters`` (cached decode and prefill against transformers' exporter
and the onnxruntime-genai builder), ``precision`` (decode and prefill in fp32, int8, int4 and
fp16, beside the builder's int4), ``serving`` (the Triton generation model under 1, 4, 16 and 32
concurrent streams with a mixed workload: static vs in-flight batching vs an int8 KV cache,
beside local generation), ``scale`` (export time, peak RSS and decode step
from ~120M to 6.7B parameters, beside the builder), ``quality`` (perplexity, KL and top-1 of
every weight format and method on the trained reference model, beside the builder's int4 and
llama.cpp's Q4_0 / Q4_K_M) and, in full runs, ``norm_folding``. Writes
``DIR/bench/<section>.json``, ``DIR/bench/*.png``, ``DIR/bench/suite.json`` (machine, command,
per-section status, wall and CPU seconds) and ``DIR/BENCHMARKS.md``; each section's wall and
CPU time (this process and its ended children, user + system) also goes to ``progress`` as it
ends. A quick run's sections share sources, traces and identical exports
(:mod:`tfgraph.bench.shared`), and torch's OpenMP threads wait passively (:data:`QUICK_ENV`).
A section that fails is recorded with its error,
the others still run, and :func:`run_suite` reports it (the CLI then exits 1).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tfgraph.bench import plots, report, shared

logger = logging.getLogger(__name__)

THREADS = 2
SECTIONS = {  # name → module; the order they run in
    "prefill": "prefill",
    "attention_memory": "attention_prefill",
    "decode": "decode",
    "compile_cost": "compile_cost",
    "peers": "peers",
    "exporters": "exporters",
    "precision": "precision",
    "serving": "serving",
    "scale": "scale",
    "norm_folding": "norm_folding",
    "quality": "quality",  # the formats' cost on the trained reference model (issue 48)
    "decode_peers": "decode_peers",  # the 1.1B int4 step through the loops users call (issue 49)
    "speculative": "speculative",  # batch 1: a draft model and prompt lookup (issue 49)
    "scale_out": "scale_out",  # replicas behind haproxy, 1 against 3, one killed (issue 49)
}


def describe_machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (ValueError, OSError):
        memory = 0.0
    versions = {}
    for name in ("tfgraph", "torch", "onnxruntime", "onnx", "onnxscript", "transformers"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except Exception:  # noqa: BLE001 - a missing package is just not listed
            continue
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": memory,
        "threads": THREADS,
        "python": platform.python_version(),
        "versions": versions,
    }


# libgomp (torch's OpenMP) spin-waits after every parallel op by default; while another
# process holds one of the 2 cores, that made each op of a tiny model ~100× slower
# (prefill.EAGER_ENV). A quick run is mostly tiny models in eager PyTorch (the parity checks
# of its exports, decode's loops): measured on a loaded machine, an int8 export of llama-tiny
# took 8-9 s CPU, 17-19 s wall spinning, 1.5-1.9 s CPU, 2-4 s wall waiting passively.
QUICK_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


@contextlib.contextmanager
def _quick_env(quick: bool, suite: dict):
    """A quick run's :data:`QUICK_ENV` (unless the caller set those variables), for the run's
    child processes and, when torch is not loaded yet, for this process too; recorded in the
    suite as ``env``."""
    if not quick:
        yield
        return
    added = {k: v for k, v in QUICK_ENV.items() if k not in os.environ}
    os.environ.update(added)
    suite["env"] = {
        "set": added,
        "this_process": "torch" not in sys.modules,  # libgomp reads it when torch loads
    }
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def cpu_seconds() -> float:
    """User + system CPU time of this process and of its children that have ended."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_suite(
    quick: bool,
    out: Path,
    *,
    only: list[str] | None = None,
    progress: Callable[[str], None] = lambda step: None,
) -> dict:
    """Run the sections (all, or ``only``), write the results under ``out``; returns the
    suite summary (``sections[name]`` has ``seconds`` and ``error`` when it failed)."""
    bench = out / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    command = "python -m tfgraph bench" + (" --quick" if quick else "") + f" --out {out}"
    suite = {
        "command": command,
        "quick": quick,
        "date": datetime.date.today().isoformat(),
    }
    with _quick_env(quick, suite):
        suite["machine"] = describe_machine()  # imports torch
        suite["sections"] = {}
        results = _run_sections(quick, only, bench, suite, progress)
    previous = bench / "suite.json"
    if only and previous.is_file():  # a partial re-run keeps the other sections' results
        old = json.loads(previous.read_text())
        suite["sections"] = {**old.get("sections", {}), **suite["sections"]}
        suite["command"] = f"{old.get('command', command)}; then {command} --only " + (
            " --only ".join(only)
        )
        for name, file in report.FILES.items():
            path = bench / file
            if name not in results and path.is_file():
                data = json.loads(path.read_text())
                if "error" not in data and "skipped" not in data:
                    results[name] = data
    suite["plots"] = plots.draw(results, bench)
    (bench / "suite.json").write_text(json.dumps(suite, indent=2) + "\n")
    report.render(out)
    return suite


def _run_sections(quick: bool, only, bench: Path, suite: dict, progress) -> dict:
    """Run the sections into ``suite["sections"]``; → their results by name."""
    results = {}
    suite_start, suite_cpu = time.perf_counter(), cpu_seconds()
    # a quick run's sections share sources, traces and identical exports (bench/shared.py);
    # the scope closes before the temp dir holding the shared artifacts goes
    with tempfile.TemporaryDirectory(prefix="tfgraph-bench-") as tmp, shared.scope(quick):
        for name, module_name in SECTIONS.items():
            if only and name not in only:
                continue
            module = importlib.import_module(f"{__package__}.{module_name}")
            workdir = Path(tmp) / name
            workdir.mkdir()
            progress(name)
            start, cpu = time.perf_counter(), cpu_seconds()
            info: dict = {}
            try:
                data = module.run(quick, workdir, progress=progress)
            except Exception as exc:  # noqa: BLE001 - recorded, the other sections still run
                logger.exception("benchmark section %s failed", name)
                first = (str(exc).splitlines() or [""])[0]
                data = {"error": f"{type(exc).__name__}: {first}"}
                info["error"] = data["error"]
            info["seconds"] = round(time.perf_counter() - start, 1)
            info["cpu_seconds"] = round(cpu_seconds() - cpu, 1)
            done = f"{name} done: {info['seconds']:.1f} s wall, {info['cpu_seconds']:.1f} s CPU"
            logger.info("%s", done)
            progress(done)
            if "skipped" in data:
                info["skipped"] = data["skipped"]
            elif "error" not in data:
                results[name] = data
            file = report.FILES.get(name, f"{name}.json")  # a section report.py does not render
            (bench / file).write_text(json.dumps(data, indent=2) + "\n")
            suite["sections"][name] = info
        if quick:
            suite["shared"] = shared.stats()
    wall, cpu = time.perf_counter() - suite_start, cpu_seconds() - suite_cpu
    suite["seconds"], suite["cpu_seconds"] = round(wall, 1), round(cpu, 1)
    logger.info("bench: %.1f s wall, %.1f s CPU", wall, cpu)
    progress(f"all sections: {wall:.1f} s wall, {cpu:.1f} s CPU")
    return results
