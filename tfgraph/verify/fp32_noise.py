"""The fp32 rule where a deep model's own rounding outgrows the fixed tolerance.

``atol 1e-4 + rtol 1e-3`` holds a model's fp32 noise up to a depth: past it, two correct fp32
computations of the same model part by more. Measured on a Flan-T5-large-shaped checkpoint
(24 + 24 layers, random weights, logits up to 3.2): ONNX Runtime's logits are 3.7e-4 from an
fp64 eager run, eager fp32 itself is 4.2e-4 from it, and the two fp32 runs are 4.5e-4 apart —
the fixed tolerance failed a correct artifact.

So an fp32 output that fails the fixed tolerance is judged again against the model's own
noise, measured as the fp16 rule measures fp16's: eager in fp64 is the exact answer, ``N``
the largest error of eager fp32 against it, and the artifact passes within
``NOISE_FACTOR · N`` plus the fixed tolerance (each fp32 run is about ``N`` from the exact
answer, so two are within ``2N`` of each other). A wrong op moves outputs by far more than
fp32 rounding, and a model shallow enough for the fixed tolerance never reaches this rule.
Costs one fp64 eager pass, only for an output that failed.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tfgraph.verify.tolerance import Tolerance

logger = logging.getLogger(__name__)

NOISE_FACTOR = 2.0


def noise_rule() -> dict:
    """The rule, for reports."""
    return {
        "factor": NOISE_FACTOR,
        "rule": f"max|export - fp32 eager| <= {NOISE_FACTOR:g} x max|fp32 eager - fp64 eager| "
        "+ the fp32 tolerance",
    }


def judge_fp32_noise(row: dict, got, want, eager64, tolerance: Tolerance, keep=None) -> dict:
    """``row`` (a failed :func:`tfgraph.verify.parity.compare` row) judged again by the noise
    rule, ``eager64`` the output of the fp64 eager model."""
    got, want, exact = (np.asarray(a, np.float64) for a in (got, want, eager64))
    if keep is not None and got.shape[:2] == keep.shape and not keep.all():
        got, want, exact = got[keep], want[keep], exact[keep]
    if got.shape != want.shape or exact.shape != want.shape or not got.size:
        return row
    noise = float(np.abs(want - exact).max())
    excess = np.abs(got - want) - tolerance.bound(want)
    passed = bool(np.isfinite(got).all() and excess.max() <= NOISE_FACTOR * noise)
    logger.info(
        "%s: fp32 noise %.3g (fp32 eager vs fp64): %s", row["name"], noise,
        "pass within the noise rule" if passed else "FAIL",
    )  # fmt: skip
    return {**row, "eager_fp64_err": noise, "passed": passed, "tolerance": noise_rule()}


def fp64_outputs(source, inputs: dict) -> dict:
    """``source``'s eager outputs in fp64, as arrays."""
    out = source.eager_in(inputs, torch.float64)
    return {n: v.double().numpy() for n, v in out.items()}
