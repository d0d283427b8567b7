"""Parity: the artifact in ONNX Runtime against eager PyTorch on random inputs.

An output passes when every element satisfies ``|ort − eager| ≤ atol + rtol·|eager|``.
``max_rel_err`` is ``max|ort − eager| / max|eager|``: the error relative to the output's scale
(an element-wise ratio explodes on outputs near zero and says nothing).

Positions before a row's first token (left padding: ``attention_mask`` 0 up to there) are
not compared: every key they may attend to is padding, so what they return is undefined (HF's
eager attention averages over the pads, a fused kernel may return anything finite).
``excluded_positions`` counts them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from tfgraph.runtime import Runner, open_runner
from tfgraph.sources.model import ModelSource
from tfgraph.verify.tolerance import FP32, PARITY_SHAPES, Tolerance

logger = logging.getLogger(__name__)


def defined_positions(mask: np.ndarray | None, start: int = 0) -> np.ndarray | None:
    """(batch, positions ≥ ``start``) booleans: True from each row's first token on, False
    over the leading padding (``mask`` is a (batch, past + new) ``attention_mask``)."""
    if mask is None or np.ndim(mask) != 2:
        return None
    return (np.cumsum(np.asarray(mask) != 0, axis=1) > 0)[:, start:]


def compare(
    name: str,
    got: np.ndarray,
    want: np.ndarray,
    tol: Tolerance,
    keep: np.ndarray | None = None,
) -> dict:
    """Error figures of one output against its reference; ``keep`` (batch, sequence) selects
    the positions compared when the output's leading axes are those."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    excluded = 0
    if keep is not None and got.shape == want.shape and got.shape[:2] == keep.shape:
        if not keep.all():
            excluded = int((~keep).sum())
            got, want = got[keep], want[keep]
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
    passed = finite and bool(np.all(diff <= tol.bound(want)))
    return {
        "name": name,
        "max_abs_err": max_abs,
        "max_rel_err": max_abs / scale if scale > 0 else max_abs,
        "tolerance": tol.as_dict(),
        "passed": passed,
        **({"excluded_positions": excluded} if excluded else {}),
    }


def missing(name: str, got: dict, tol: Tolerance) -> dict:
    """The row of an output the source returns but the artifact does not: a failure that says
    which outputs the artifact has (a graph whose outputs were renamed, or dropped)."""
    return {
        "name": name,
        "max_abs_err": float("inf"),
        "max_rel_err": float("inf"),
        "tolerance": tol.as_dict(),
        "passed": False,
        "error": f"the artifact has no output '{name}' (its outputs: {', '.join(got) or 'none'})",
    }


def compare_in(
    name: str,
    got: np.ndarray,
    want: np.ndarray,
    want_low: np.ndarray,
    precision: str,
    keep: np.ndarray | None = None,
    tolerance: Tolerance = FP32,
) -> dict:
    """An output of an export in ``precision`` (fp16, bf16) against fp32 eager (``want``) and
    eager in that precision (``want_low``): :func:`tfgraph.precision.islands.judge`'s rule,
    in the row format of :func:`compare`. In fp32 ``want_low`` is the reference without its
    activation quantization (:func:`eager_outputs`), judged by
    :func:`tfgraph.verify.activation_rule.judge_activations`."""
    if precision == "fp32":
        from tfgraph.verify.activation_rule import activation_rule, judge_activations

        row = judge_activations(got, want, want_low, keep, tolerance)
        return {"name": name, "tolerance": activation_rule(), **row}
    from tfgraph.precision.islands import judge, rule

    row = judge(got, want, want_low, precision, keep)
    return {"name": name, "tolerance": rule(precision), **row}


def eager_outputs(source: ModelSource, inputs: dict, precision: str) -> tuple[dict, dict | None]:
    """fp32 eager outputs, and eager outputs in ``precision`` (None for fp32), as arrays. The
    eager reference of weights whose kernel quantizes activations (``--accuracy-level 4``)
    gives, in fp32, its outputs without that quantization in place of the second."""
    want = {n: v.float().numpy() for n, v in source.eager(inputs).items()}
    if precision == "fp32":
        from tfgraph.exporters.ort.weights.activations import without_activation_quantization

        plain = without_activation_quantization(source, inputs)
        if plain is None:
            return want, None
        return want, {n: v.float().numpy() for n, v in plain.items()}
    from tfgraph.precision.islands import TORCH_TYPES

    low = source.eager_in(inputs, TORCH_TYPES[precision])
    return want, {n: v.float().numpy() for n, v in low.items()}


def check_parity(
    source: ModelSource,
    model_file: Path,
    *,
    shapes=PARITY_SHAPES,
    tolerance: Tolerance = FP32,
    seed: int = 0,
    precision: str = "fp32",
) -> dict:
    """Run both sides at each shape; ``outputs[]`` holds the worst case per output; ``runner``
    says what ran the artifact (the runner its target names). In fp16/bf16 the rule is
    :func:`compare_in`'s and ``tolerance`` is not used."""
    session = open_runner(model_file, checking=True)
    source = source.on_device(eager_device(session))
    cases = []
    for i, (batch, seq) in enumerate(shapes):
        inputs = source.inputs(batch, seq, seed=seed + i)
        want, want_low = eager_outputs(source, inputs, precision)
        got = session.run(inputs)
        keep = defined_positions(_mask_of(source, session, inputs))
        for name in source.output_names:
            row = _row(source, inputs, name, got, (want, want_low), precision, tolerance, keep)
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
        outputs.append(summarize(name, rows, tolerance))
    return {
        "passed": all(o["passed"] for o in outputs),
        "outputs": outputs,
        "cases": cases,
        "shapes": [list(s) for s in shapes],
        "runner": runner_info(session),
        "eager_device": source.device,
    }


def _row(
    source, inputs, name: str, got: dict, wants: tuple, precision: str, tol: Tolerance, keep
) -> dict:
    """One output at one shape: :func:`compare_fp32` (fp32), :func:`compare_in` (with a
    second reference), :func:`missing` when the artifact does not return it."""
    want, want_low = wants
    if name not in got:
        row = missing(name, got, tol)
        logger.warning("parity %s: %s", name, row["error"])
        return row
    if want_low is None:
        return compare_fp32(source, inputs, name, got[name], want[name], tol, keep)
    return compare_in(name, got[name], want[name], want_low[name], precision, keep, tol)


def summarize(name: str, rows: list[dict], tolerance: Tolerance) -> dict:
    """The worst case of one output over its rows (and eager's own error in a low precision)."""
    out = {
        "name": name,
        "max_abs_err": max(r.get("max_abs_err", float("inf")) for r in rows),
        "max_rel_err": max(r.get("max_rel_err", float("inf")) for r in rows),
        "tolerance": ruling(rows, tolerance),
        "passed": all(r["passed"] for r in rows),
    }
    for key in BRACKET_KEYS:
        if any(key in r for r in rows):
            out[key] = max(r[key] for r in rows)
    errors = [r["error"] for r in rows if r.get("error")]
    if errors:
        out["error"] = errors[0]
    return out


# the second reference's error that a rule allows a multiple of: eager in a low precision,
# the reference's activation quantization, fp32 eager's own rounding (against fp64)
BRACKET_KEYS = ("eager_low_err", "activation_quant_err", "eager_fp64_err")


def ruling(rows: list[dict], tolerance: Tolerance) -> dict:
    """The rule an output was judged by: the fp32 noise rule where a case needed it."""
    noisy = [r["tolerance"] for r in rows if "eager_fp64_err" in r]
    return noisy[0] if noisy else rows[0].get("tolerance", tolerance.as_dict())


def compare_fp32(source, inputs, name, got, want, tol, keep=None, rows=slice(None)) -> dict:
    """:func:`compare`, and an output that fails it judged again by the model's own fp32
    noise (:mod:`tfgraph.verify.fp32_noise`: one fp64 eager pass on ``inputs``, its
    sequence ``rows``); a zero tolerance asks for bit-exact outputs and is not widened."""
    row = compare(name, got, want, tol, keep)
    if row["passed"] or "error" in row or not np.isfinite(row["max_abs_err"]):
        return row
    if tol.atol == 0 and tol.rtol == 0:  # --atol 0 --rtol 0 asks for bit-exact outputs
        return row
    from tfgraph.verify.fp32_noise import fp64_outputs, judge_fp32_noise

    exact = fp64_outputs(source, inputs)[name][:, rows]
    return judge_fp32_noise(row, got, want, exact, tol, keep)


def _mask_of(source: ModelSource, runner: Runner, inputs: dict) -> np.ndarray | None:
    """The ``attention_mask`` of a causal LM (``source.info["causal_lm"]``): its leading pads
    see nothing. Other models compare every position."""
    from tfgraph import contract

    if not source.info.get("causal_lm"):
        return None
    for port in runner.signature.inputs_with(contract.ATTENTION_MASK):
        if port.name in inputs:
            return inputs[port.name].numpy()
    return None


def eager_device(runner: Runner) -> str:
    """Where the eager reference runs: on the runner's own GPU when torch sees one (a TensorRT
    engine, ONNX Runtime's CUDA provider: GPU fp16 against GPU fp16), else on the CPU."""
    on_gpu = runner.device.startswith("cuda") and torch.cuda.is_available()
    return runner.device if on_gpu else "cpu"


def runner_info(runner: Runner) -> dict:
    """Which runner verified an artifact, on which device (``report.json``)."""
    info = {"runner": type(runner).__name__, "device": runner.device}
    providers = getattr(runner, "providers", None)
    if providers is not None:
        info["providers"] = list(providers)
    return info
