"""Prefill latency and peak memory against sequence length, eager PyTorch vs exported graphs.

Two zoo models (full run: ``gpt2-small`` as decoder, ``bert-tiny`` as encoder, both with
``max_seq_len`` raised to 8192; quick run: ``gpt-tiny`` and ``bert-tiny`` as they are, at
lengths 64 and 128), each measured in
five configurations at batch 1:

- ``eager``: the PyTorch module (``torch.no_grad()``, ``torch.set_num_threads(threads)``);
- ``unfused``: ``tfgraph.export(..., pipeline="none")`` run in ONNX Runtime;
- ``ort``, ``onnx``, ``tensorrt``: ``tfgraph.export(..., pipeline="default", target=P)`` run
  in ONNX Runtime. The ``tensorrt`` graph holds standard ops only; TensorRT is not installed,
  so it runs on ONNX Runtime's CPU provider too (``NOTES`` says so in the result).

Every (model, configuration, sequence length) runs in a fresh process, so that its peak RSS is
its own: ONNX Runtime through :func:`tfgraph.bench.ort_probe.probe` (a process that never
imports torch), eager PyTorch through this module's ``_eager_main``, which measures the same
way (one warm-up, then the median of ``repeats`` runs; VmHWM reset through
``/proc/self/clear_refs`` once the model and inputs exist). Inputs are the same everywhere:
token ids drawn by ``numpy.random.default_rng(0)`` in [1, vocab), ``attention_mask`` all ones.
The eager process runs with ``OMP_WAIT_POLICY=PASSIVE`` (:data:`EAGER_ENV` says why).

A configuration whose estimated peak memory is above :data:`MEMORY_LIMIT_GIB` (or above 90% of
the memory available when it starts) is skipped, as is one whose process fails (timeout, OOM
kill): its entry is ``{"skipped": reason}``.

    python -m tfgraph.bench.prefill [--quick] [--out prefill.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tfgraph.bench import shared
from tfgraph.bench.ort_probe import measure, probe

logger = logging.getLogger(__name__)

CONFIGS = ("eager", "unfused", "ort", "onnx", "tensorrt")
EXPORTS = {  # configuration → (pipeline, target)
    "unfused": ("none", "ort"),
    "ort": ("default", "ort"),
    "onnx": ("default", "onnx"),
    "tensorrt": ("default", "tensorrt"),
}
# libgomp's default spin-waiting made every parallel op of torch take ~8 ms (100× slower at
# gpt-tiny size) whenever another process held one of the 2 cores; passive waiting does not.
EAGER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
NOTES = {
    "eager": "PyTorch eager, torch.no_grad(), OMP_WAIT_POLICY=PASSIVE",
    "unfused": "pipeline none (graph as exported), ONNX Runtime CPU",
    "ort": "pipeline default, profile ort, ONNX Runtime CPU",
    "onnx": "pipeline default, profile onnx (standard ops, opset 23), ONNX Runtime CPU",
    "tensorrt": "pipeline default, profile tensorrt (standard ops), run in ONNX Runtime CPU: "
    "TensorRT is not installed",
}
MAX_SEQ_LEN = 8192
MEMORY_LIMIT_GIB = 18.0
TIMEOUT_S = 1800.0
# Copies of one layer's (heads, seq, seq) fp32 scores a configuration holds at once, rounded
# up from what the run's extra RSS was at 4096 on a 12-head, 1-layer model (eager 2.1, unfused
# 2.5, onnx 1.1, tensorrt 2.4; ort: 0.04 for the causal decoder's GroupQueryAttention, 1.2 for
# the masked encoder's).
SCORE_COPIES = {"eager": 3, "unfused": 4, "onnx": 2, "tensorrt": 4}
ORT_SCORE_COPIES = {"decoder": 0, "encoder": 2}
BASE_MIB = 500  # interpreter, torch or ONNX Runtime, arenas


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    preset: str
    overrides: dict = dataclasses.field(default_factory=lambda: {"max_seq_len": MAX_SEQ_LEN})


@dataclasses.dataclass(frozen=True)
class Plan:
    models: dict[str, ModelSpec]  # label → spec
    seqs: tuple[int, ...]
    repeats: Callable[[int], int]  # sequence length → timed runs


def _full_repeats(seq: int) -> int:
    return 5 if seq <= 512 else 3 if seq <= 2048 else 1


FULL_PLAN = Plan(
    models={"gpt2-small": ModelSpec("gpt2-small"), "bert-tiny": ModelSpec("bert-tiny")},
    seqs=(128, 512, 2048, 8192),
    repeats=_full_repeats,
)
# quick: the presets as they are (max_seq_len 128), so that peers' gpt-tiny is this one
QUICK_PLAN = Plan(
    models={
        "gpt-tiny": ModelSpec("gpt-tiny", overrides={}),
        "bert-tiny": ModelSpec("bert-tiny", overrides={}),
    },
    seqs=(64, 128),
    repeats=lambda seq: 3,
)


# --- models -----------------------------------------------------------------------------------


def _model_config(preset: str, overrides: dict):
    from tfgraph.models import PRESETS

    return dataclasses.replace(PRESETS[preset], **overrides)


def _build(preset: str, overrides: dict):
    from tfgraph.models import build

    return build(_model_config(preset, overrides), seed=0)


def _input_spec(names: tuple[str, ...], vocab: int, seq: int) -> dict[str, dict]:
    """ort_probe's input description: token ids in [1, vocab), masks all ones."""
    return {name: {"shape": [1, seq], "dtype": "int64", "high": vocab} for name in names}


def source_key(preset: str, overrides: dict) -> tuple:
    """The key of a zoo module's source in :mod:`tfgraph.bench.shared` (peers uses it too)."""
    return ("module", preset, tuple(sorted(overrides.items())))


def _export_all(
    label: str, module, spec: ModelSpec, workdir: Path, progress: Callable[[str], None]
) -> tuple[dict, dict[str, Path | str]]:
    """Export every ONNX configuration once; → (parity_passed, config → model.onnx or error).
    In a quick run, the configurations share one trace per opset (:mod:`tfgraph.bench.shared`)."""
    import tfgraph

    source = shared.source(
        source_key(spec.preset, spec.overrides),
        lambda: tfgraph.from_module(module, origin=f"preset:{spec.preset}"),
    )
    parity, models = {}, {}
    for config, (pipeline, target) in EXPORTS.items():
        progress(f"prefill {label} export {config}")
        out = workdir / "prefill" / label / config
        shutil.rmtree(out, ignore_errors=True)  # a previous run's artifact
        try:
            result = shared.export(source, out, pipeline=pipeline, target=target)
        except Exception as exc:  # one failed export skips its configuration, not the suite
            logger.exception("prefill: exporting %s %s failed", label, config)
            parity[config] = False
            models[config] = f"export failed: {type(exc).__name__}: {exc}"
            continue
        parity[config] = result.passed
        models[config] = out / "model.onnx"
        if not result.passed:
            logger.warning("prefill: %s %s export failed parity", label, config)
    return parity, models


# --- memory estimate --------------------------------------------------------------------------


def _estimate_mib(cfg, params: int, seq: int, config: str) -> float:
    """Rough peak RSS of one prefill at batch 1 (fp32): weights, scores, logits, activations."""
    mib = 1024**2
    weights = 4 * params * (1 if config == "eager" else 2)  # ORT: proto + initializers at load
    copies = ORT_SCORE_COPIES[cfg.family] if config == "ort" else SCORE_COPIES[config]
    scores = 4 * cfg.n_heads * seq * seq * copies
    width = cfg.vocab_size if cfg.family == "decoder" else cfg.d_model
    outputs = 2 * 4 * seq * width
    activations = 4 * 4 * seq * cfg.ffn_dim
    return BASE_MIB + (weights + scores + outputs + activations) / mib


def _available_mib() -> float:
    with open("/proc/meminfo") as f:
        line = next(line for line in f if line.startswith("MemAvailable:"))
    return int(line.split()[1]) / 1024


def _memory_skip(estimate_mib: float) -> str | None:
    limit = min(MEMORY_LIMIT_GIB * 1024, 0.9 * _available_mib())
    if estimate_mib <= limit:
        return None
    return f"estimated peak {estimate_mib / 1024:.1f} GiB > limit {limit / 1024:.1f} GiB"


# --- measuring --------------------------------------------------------------------------------


def _eager_probe(spec: ModelSpec, inputs: dict, repeats: int, threads: int) -> dict:
    """Run :func:`_eager_main` in a fresh process; its last stdout line is the result."""
    job = {
        "preset": spec.preset,
        "overrides": spec.overrides,
        "inputs": inputs,
        "repeats": repeats,
        "threads": threads,
    }
    code = "import sys; from tfgraph.bench.prefill import _eager_main; _eager_main(sys.argv[1])"
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(job)],
        check=True,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, **EAGER_ENV},
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _failure(exc: Exception) -> str:
    if isinstance(exc, subprocess.TimeoutExpired):
        return f"timed out after {exc.timeout:.0f} s"
    if isinstance(exc, subprocess.CalledProcessError):
        tail = (exc.stderr or "").strip().splitlines()[-1:] or [""]
        if exc.returncode < 0:
            return f"killed by signal {-exc.returncode} (out of memory?) {tail[0]}".strip()
        return f"exit status {exc.returncode}: {tail[0]}".strip()
    return f"{type(exc).__name__}: {exc}"


def _measure(config: str, target, spec: ModelSpec, inputs: dict, repeats: int, threads: int):
    """One configuration at one length: the probe's result, or ``{"skipped": reason}``."""
    if isinstance(target, str):  # the export failed
        return {"skipped": target}
    try:
        if config == "eager":
            return _eager_probe(spec, inputs, repeats, threads)
        return probe(target, inputs, repeats=repeats, threads=threads, timeout=TIMEOUT_S)
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        logger.warning("prefill: %s failed: %s", config, exc)
        return {"skipped": _failure(exc)}


def _ratios(configs: dict, seqs: list[int]) -> dict:
    """Per configuration and length: eager/config latency, config/unfused process peak RSS."""
    ratios: dict = {}
    for config in CONFIGS:
        ratios[config] = {}
        for seq in map(str, seqs):
            eager, this, unfused = (configs[c][seq] for c in ("eager", config, "unfused"))
            missing = sorted(
                {c for c in ("eager", config, "unfused") if "skipped" in configs[c][seq]}
            )
            if missing:
                ratios[config][seq] = {"skipped": f"no measurement for {', '.join(missing)}"}
                continue
            ratios[config][seq] = {
                "eager_over_config_latency": eager["seconds"] / this["seconds"],
                "config_over_unfused_peak_rss": this["peak_rss_mib"] / unfused["peak_rss_mib"],
            }
    return ratios


def _run_model(
    label: str, spec: ModelSpec, plan: Plan, workdir: Path, threads: int, progress
) -> dict:
    module = _build(spec.preset, spec.overrides)
    cfg, params = module.config, sum(p.numel() for p in module.parameters())
    input_names = module.input_names
    parity, targets = _export_all(label, module, spec, workdir, progress)
    del module  # the eager measurements build their own, in their own process
    gc.collect()
    configs: dict = {c: {} for c in CONFIGS}
    for seq in plan.seqs:
        inputs = _input_spec(input_names, cfg.vocab_size, seq)
        repeats = plan.repeats(seq)
        for config in CONFIGS:
            progress(f"prefill {label} {config} {seq}")
            skip = _skip_reason(cfg, params, seq, config)
            if skip:
                logger.info("prefill: %s %s %d skipped: %s", label, config, seq, skip)
                configs[config][str(seq)] = {"skipped": skip}
                continue
            configs[config][str(seq)] = _measure(
                config, targets.get(config), spec, inputs, repeats, threads
            )
    return {
        "family": cfg.family,
        "preset": spec.preset,
        "layers": cfg.n_layers,
        "d_model": cfg.d_model,
        "max_seq_len": cfg.max_seq_len,
        "parameters": params,
        "parity_passed": parity,
        "configs": configs,
        "ratios": _ratios(configs, list(plan.seqs)),
    }


def _skip_reason(cfg, params: int, seq: int, config: str) -> str | None:
    if seq > cfg.max_seq_len:
        return f"sequence {seq} > max_seq_len {cfg.max_seq_len}"
    return _memory_skip(_estimate_mib(cfg, params, seq, config))


def run(
    quick: bool,
    workdir: Path,
    threads: int = 2,
    progress: Callable[[str], None] = lambda s: None,
) -> dict:
    """Measure every model × configuration × sequence length of the plan.

    Returns ``{"threads", "seqs", "quick", "repeats": {seq: n}, "notes": {config: text},
    "models": {label: {"family", "preset", "layers", "d_model", "max_seq_len", "parameters",
    "parity_passed": {config: bool}, "configs": {config: {seq: measurement}},
    "ratios": {config: {seq: {"eager_over_config_latency", "config_over_unfused_peak_rss"}}}}}}``
    with sequence keys as strings; a measurement is ``{"seconds", "peak_rss_mib",
    "run_extra_rss_mib", "rss_before_run_mib"}``, and a measurement or ratio that could not be
    made is ``{"skipped": reason}``.
    """
    plan = QUICK_PLAN if quick else FULL_PLAN
    with shared.scope(quick):
        return _run_plan(plan, quick, Path(workdir), threads, progress)


def _run_plan(plan: Plan, quick: bool, workdir: Path, threads: int, progress) -> dict:
    result = {
        "threads": threads,
        "seqs": list(plan.seqs),
        "quick": quick,
        "repeats": {str(s): plan.repeats(s) for s in plan.seqs},
        "notes": dict(NOTES),
        "models": {},
    }
    for label, spec in plan.models.items():
        start = time.perf_counter()
        result["models"][label] = _run_model(label, spec, plan, workdir, threads, progress)
        logger.info("prefill: %s took %.1f s", label, time.perf_counter() - start)
    return result


# --- the eager child process ------------------------------------------------------------------


def _eager_feeds(inputs: dict):
    """The same arrays as ort_probe makes from the same description, as torch tensors."""
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    feeds = {}
    for name, desc in inputs.items():
        dtype = np.dtype(desc.get("dtype", "int64"))
        if "mask" in name:
            array = np.ones(desc["shape"], dtype)
        else:
            array = rng.integers(1, desc.get("high", 256), desc["shape"]).astype(dtype)
        feeds[name] = torch.from_numpy(array)
    return feeds


def _eager_main(job_json: str) -> None:
    import torch

    job = json.loads(job_json)
    torch.set_num_threads(job["threads"])
    module = _build(job["preset"], job["overrides"])
    feeds = _eager_feeds(job["inputs"])
    args = [feeds[n] for n in module.input_names]
    with torch.no_grad():
        result = measure(lambda: module(*args), job["repeats"])
    sys.stdout.write(json.dumps(result) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, lengths 64 and 128")
    parser.add_argument("--out", type=Path, help="write the result here as JSON")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, help="where the exports go (default: a temp dir)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.quick, args.workdir or Path(tmp), args.threads, progress=logger.info)
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
