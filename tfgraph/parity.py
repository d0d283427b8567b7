"""Parity: the artifact in ONNX Runtime against eager PyTorch on random inputs.

An output passes when every element satisfies ``|ort − eager| ≤ atol + rtol·|eager|``.
``max_rel_err`` is ``max|ort − eager| / max|eager|``: the error relative to the output's scale
(an element-wise ratio explodes on outputs near zero and says nothing).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tfgraph.runtime import Runner, open_runner

from .sources import ModelSource

logger = logging.getLogger(__name__)

PARITY_SHAPES = ((1, 7), (2, 33))  # (batch, sequence)


@dataclass(frozen=True)
class Tolerance:
    atol: float = 1e-4
    rtol: float = 1e-3

    def as_dict(self) -> dict:
        return {"atol": self.atol, "rtol": self.rtol}


FP32 = Tolerance()


def compare(name: str, got: np.ndarray, want: np.ndarray, tol: Tolerance) -> dict:
    """Error figures of one output against its reference."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return {
            "name": name,
            "max_abs_err": float("inf"),
            "max_rel_err": float("inf"),
            "tolerance": tol.as_dict(),
            "passed": False,
            "error": f"shape {got.shape} != eager {want.shape}",
        }
    diff = np.abs(got - want)
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(want).max()) if want.size else 0.0
    finite = bool(np.isfinite(got).all() == np.isfinite(want).all())
    passed = finite and bool(np.all(diff <= tol.atol + tol.rtol * np.abs(want)))
    return {
        "name": name,
        "max_abs_err": max_abs,
        "max_rel_err": max_abs / scale if scale > 0 else max_abs,
        "tolerance": tol.as_dict(),
        "passed": passed,
    }


def check_parity(
    source: ModelSource,
    model_file: Path,
    *,
    shapes=PARITY_SHAPES,
    tolerance: Tolerance = FP32,
    seed: int = 0,
) -> dict:
    """Run both sides at each shape; ``outputs[]`` holds the worst case per output; ``runner``
    says what ran the artifact (the runner its target names)."""
    session = open_runner(model_file)
    cases = []
    for i, (batch, seq) in enumerate(shapes):
        inputs = source.inputs(batch, seq, seed=seed + i)
        want = source.eager(inputs)
        got = session.run(inputs)
        for name in source.output_names:
            row = compare(name, got[name], want[name].float().numpy(), tolerance)
            cases.append({"batch": batch, "sequence": seq, **row})
            logger.info(
                "parity %s b=%d s=%d: max_abs=%.3g passed=%s",
                name,
                batch,
                seq,
                row["max_abs_err"],
                row["passed"],
            )
    outputs = []
    for name in source.output_names:
        rows = [c for c in cases if c["name"] == name]
        outputs.append(
            {
                "name": name,
                "max_abs_err": max(r["max_abs_err"] for r in rows),
                "max_rel_err": max(r["max_rel_err"] for r in rows),
                "tolerance": tolerance.as_dict(),
                "passed": all(r["passed"] for r in rows),
            }
        )
    return {
        "passed": all(o["passed"] for o in outputs),
        "outputs": outputs,
        "cases": cases,
        "shapes": [list(s) for s in shapes],
        "runner": runner_info(session),
    }


def runner_info(runner: Runner) -> dict:
    """Which runner verified an artifact, on which device (``report.json``)."""
    info = {"runner": type(runner).__name__, "device": runner.device}
    providers = getattr(runner, "providers", None)
    if providers is not None:
        info["providers"] = list(providers)
    return info
