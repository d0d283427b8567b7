"""The parity rule of an artifact whose kernels quantize activations (``MatMulNBits`` at
accuracy level 4): within :data:`ACTIVATION_FACTOR` times the activation quantization's own
effect, plus the tolerance of the check (fp32's; an int8 KV cache's rule adds its own measured
effect to it, :mod:`tfgraph.verify.kv_quantization`)."""

from __future__ import annotations

import numpy as np

from tfgraph.verify.tolerance import FP32, Tolerance

ACTIVATION_FACTOR = 2.0


def activation_rule() -> dict:
    """The passing rule of an artifact whose kernels quantize activations, for reports."""
    return {
        "factor": ACTIVATION_FACTOR,
        "rule": f"max|export - reference| <= {ACTIVATION_FACTOR:g} x max|reference without "
        "activation quantization - reference| + the tolerance at the output's scale (fp32's; "
        "with an int8 KV cache, its measured effect added)",
    }


def allowed_error(effect: float, scale: float, tolerance: Tolerance = FP32) -> float:
    """The rule's bound: ``effect`` (the activation quantization's own, 0 without it) at an
    output whose largest magnitude is ``scale``, plus ``tolerance`` (the fp32 one, or one
    that already holds another measured effect: an int8 KV cache's)."""
    return ACTIVATION_FACTOR * effect + tolerance.atol + tolerance.rtol * scale


def judge_activations(got, want, plain, keep=None, tolerance: Tolerance = FP32) -> dict:
    """One output of an artifact whose MatMulNBits quantize activations (accuracy level 4)
    against the reference that quantizes them alike (``want``) and the same reference without
    that quantization (``plain``).

    Rounding to int8 is discontinuous: fp32 noise of the order of 1e-7 in an activation flips
    the rounding of an element that sits at a half step, and one flip moves the output by
    about as much as the whole activation quantization does (measured: a perturbation of
    1e-6 relative moved gpt2-tiny's logits by 0.13 where all of the activation quantization
    moved them by 0.16). Exact parity is not to be had; the artifact passes when it is within
    :data:`ACTIVATION_FACTOR` times the activation quantization's own effect (plus the fp32
    tolerance): a wrong weight, scale or layer moves outputs by the weight quantization's
    error or more, 20x that effect on the zoo's tiny presets."""
    got, want, plain = (np.asarray(a, np.float64) for a in (got, want, plain))
    if keep is not None and got.shape[:2] == keep.shape and not keep.all():
        got, want, plain = got[keep], want[keep], plain[keep]
    if got.shape != want.shape:
        return {"passed": False, "error": f"shape {got.shape} != eager {want.shape}"}
    scale = float(np.abs(want).max()) if want.size else 0.0
    err = float(np.abs(got - want).max()) if got.size else 0.0
    effect = float(np.abs(plain - want).max()) if plain.size else 0.0
    allowed = allowed_error(effect, scale, tolerance)
    finite = bool(np.isfinite(got).all())
    return {
        "max_abs_err": err,
        "max_rel_err": err / scale if scale > 0 else err,
        "activation_quant_err": effect,
        "allowed": allowed,
        "passed": finite and err <= allowed,
    }
