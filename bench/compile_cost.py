"""Compile cost against depth: ``tfgraph.export`` of a GPT-like zoo decoder at growing layer counts.

The model is ``gpt-tiny`` (d_model 64, 4 heads, vocab 256) with ``n_layers`` replaced, so that
64 layers stay affordable and the cost measured is the compiler's per-node work, not weight
copying. Each layer count is exported once with the ``default`` pipeline for the ``ort``
profile; the figures are the export's own timings (``report["timings"]``: trace, passes,
save, parity; no load, the module is built beforehand) and the per-pass seconds
(``report["passes"]``).

Cost should grow about linearly with depth: :func:`per_doubling` gives, between consecutive
layer counts a < b, the factor per doubling of layers ``(t_b / t_a) ** (1 / log2(b / a))``
(2.0 is linear, 4.0 quadratic), for the total and for trace and passes separately, plus the
overall factor from the first layer count to the last.

One untimed export of a 1-layer model runs first: the first export in a process pays for
torch.export's and the ONNX exporter's one-time setup, which would otherwise inflate the
smallest model's time and flatten the growth. A quick run whose earlier sections already
exported (:func:`tfgraph.bench.shared.warm`) skips it: that setup is paid. This section never
shares traces: it times them.

    python -m tfgraph.bench.compile_cost [--quick] [--out compile_cost.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

logger = logging.getLogger(__name__)

PRESET = "gpt-tiny"
FULL_LAYERS = [2, 8, 32, 64]
QUICK_LAYERS = [1, 2]
WARMUP_LAYERS = 1  # untimed first export (one-time setup of the exporter); 0 disables it
STEPS = ("trace", "passes", "save", "parity")


def _no_progress(message: str) -> None:
    pass


def _source(n_layers: int):
    """The preset with ``n_layers`` layers, as a :class:`tfgraph.ModelSource`."""
    import tfgraph
    from tfgraph.models.presets import PRESETS, build

    config = replace(PRESETS[PRESET], n_layers=n_layers)
    return tfgraph.from_module(build(config), origin=f"preset:{PRESET}[n_layers={n_layers}]")


def _export(n_layers: int, out_dir: Path) -> tuple[dict, float]:
    """Export once; returns the report and the wall time of the export call."""
    import tfgraph

    source = _source(n_layers)
    start = time.perf_counter()
    result = tfgraph.export(source, out_dir, pipeline="default", target="ort")
    wall = time.perf_counter() - start
    if not result.passed:
        logger.warning("compile_cost: %d layers exported but parity failed", n_layers)
    return result.report, wall


def _row(n_layers: int, report: dict, wall: float) -> dict:
    """One row of the result from an export report."""
    timings = report["timings"]
    steps = {f"{name}_s": float(timings.get(name, 0.0)) for name in STEPS}
    per_pass: dict[str, float] = {}
    for record in report["passes"]:  # a pass class may run more than once: Name, Name#2, …
        name = record["name"].split("#")[0]
        per_pass[name] = per_pass.get(name, 0.0) + float(record["seconds"])
    return {
        "layers": n_layers,
        "total_s": round(sum(steps.values()), 3),
        **steps,
        "per_pass": {name: round(seconds, 4) for name, seconds in per_pass.items()},
        "wall_s": round(wall, 3),
        "parity_passed": bool(report["parity"]["passed"]),
    }


def growth(a: int, b: int, t_a: float, t_b: float) -> float | None:
    """Factor per doubling of layers between (a, t_a) and (b, t_b); None when undefined."""
    if a <= 0 or b <= a or t_a <= 0 or t_b <= 0:
        return None
    return (t_b / t_a) ** (1 / math.log2(b / a))


def per_doubling(rows: Sequence[dict]) -> dict:
    """Per-doubling factors between consecutive rows, for total, trace and passes."""
    out: dict = {}
    for key in ("total", "trace", "passes"):
        out[key] = [
            growth(a["layers"], b["layers"], a[f"{key}_s"], b[f"{key}_s"])
            for a, b in pairwise(rows)
        ]
    first, last = rows[0], rows[-1]
    out["total_overall"] = growth(
        first["layers"], last["layers"], first["total_s"], last["total_s"]
    )
    return out


def run(quick: bool, workdir: Path, progress: Callable[[str], None] = _no_progress) -> dict:
    """Export at each layer count (``QUICK_LAYERS`` or ``FULL_LAYERS``) under ``workdir``."""
    from tfgraph.bench import shared
    from tfgraph.models.presets import PRESETS

    layers = list(QUICK_LAYERS if quick else FULL_LAYERS)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    warmup = WARMUP_LAYERS if not (quick and shared.warm()) else 0
    if warmup:
        progress(f"warm-up export ({warmup} layer)")
        _export(warmup, workdir / "warmup")
    rows = []
    for n in layers:
        progress(f"export {PRESET} with {n} layer{'s' if n != 1 else ''}")
        report, wall = _export(n, workdir / f"layers_{n}")
        rows.append(_row(n, report, wall))
        logger.info("compile_cost: %d layers, %.2f s (wall %.2f s)", n, rows[-1]["total_s"], wall)
        gc.collect()
    return {
        "layers": layers,
        "rows": rows,
        "per_doubling": per_doubling(rows),
        "preset": PRESET,
        "d_model": PRESETS[PRESET].d_model,
        "warmup_layers": warmup,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"layers {QUICK_LAYERS}")
    parser.add_argument("--out", type=Path, default=Path("compile_cost.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)  # this module's messages, not every pass's
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.quick, Path(tmp), progress=logger.info)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
