"""Which bits and method each MatMul weight gets (:func:`plan_nodes`), and ``--weights mixed``:
int4 for most MatMul weights, int8 for the most sensitive ones, chosen by measured sensitivity.

A weight's sensitivity is its int4 error weighted by its input's energy on the calibration text
(the diagonal of the input Hessian, :mod:`tfgraph.exporters.ort.weights.calibration`):

    S = Σ_k E[x_k²]·‖ΔW_k‖² / Σ_k E[x_k²]·‖W_k‖²

(k along the reduction axis, ΔW the int4 quantization error of the method asked for; GPTQ's
needs each weight's whole Hessian, so its sensitivity is measured with round to nearest). It is
the expected squared output error of the weight relative to its output, for inputs with
independent features. The most sensitive weights go int8 until they hold ``int8_share`` of the
MatMul weights' elements; the rest int4.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from tfgraph.errors import TfgraphError
from tfgraph.exporters.ort.weights.calibration import (
    Calibrator,
    budget_groups,
    calibration_windows,
    tokens_of,
    weight_modules,
)
from tfgraph.exporters.ort.weights.dequantize import dequantize_parts
from tfgraph.exporters.ort.weights.methods import ASYMMETRIC_ONLY, node_quantizer
from tfgraph.exporters.ort.weights.nbits import rtn_quantizer

logger = logging.getLogger(__name__)

DEFAULT_INT8_SHARE = 0.125
KEEP_BYTES = 1 << 30  # int4 parts held between reads (module doc of nbits.NodeQuantizer.keep)


def check_share(share: float) -> None:
    if not 0 <= share <= 1:
        raise TfgraphError(f"--int8-share {share}: give a fraction of the weights from 0 to 1")


def sensitivity(rows: np.ndarray, parts: tuple, energy: np.ndarray, bits: int, block: int):
    """S (module doc) of weight ``rows`` (N, K) quantized to ``parts``, input energy (K,)."""
    deq = dequantize_parts(*parts, bits, block, rows.shape[1])
    error = ((deq - rows) ** 2).sum(axis=0) @ energy
    total = (rows.astype(np.float64) ** 2).sum(axis=0) @ energy
    return float(error / total) if total > 0 else 0.0


def choose(measured: list[dict], share: float) -> set[str]:
    """The nodes to put in int8: the most sensitive of ``measured`` (``{node, sensitivity,
    elements}``) while their elements stay within ``share`` of all."""
    budget = share * sum(m["elements"] for m in measured)
    chosen, held = set(), 0
    for entry in sorted(measured, key=lambda m: -m["sensitivity"]):
        if held + entry["elements"] <= budget:
            chosen.add(entry["node"])
            held += entry["elements"]
    return chosen


def measure(pairs: list, modules: dict, energies: dict, int4_of, block: int) -> list[dict]:
    """``{node, module, sensitivity, elements}`` of each (node, weight) in ``pairs``;
    ``int4_of(node, weight)``: its int4 NodeQuantizer; ``energies``: module → E[x²]."""
    from tfgraph.exporters.ort.weights.nbits import _block_quantized, weight_rows

    measured = []
    for node, weight in pairs:
        spec = int4_of(node, weight)
        parts = _block_quantized(spec.quantize, weight.const_value)
        rows = np.asarray(weight_rows(weight.const_value), dtype=np.float32)
        module = modules[node.name]
        value = sensitivity(rows, parts, energies[module], spec.bits, block)
        measured.append(
            {
                "node": node.name,
                "module": module,
                "sensitivity": value,
                "elements": int(rows.size),
            }
        )
        del rows, parts
    return measured


def report(measured: list[dict], chosen: set[str], share: float) -> dict:
    """What the report says: the share asked and held, and each weight's sensitivity and bits,
    most sensitive first."""
    total = sum(m["elements"] for m in measured) or 1
    held = sum(m["elements"] for m in measured if m["node"] in chosen)
    rows = [
        {
            "module": m["module"],
            "node": m["node"],
            "sensitivity": m["sensitivity"],
            "bits": 8 if m["node"] in chosen else 4,
        }
        for m in sorted(measured, key=lambda m: -m["sensitivity"])
    ]
    logger.info(
        "mixed: %d of %d weights in int8 (%.1f%% of the elements, share %.3f)",
        len(chosen),
        len(measured),
        100 * held / total,
        share,
    )
    return {"int8_share": share, "int8_held": held / total, "sensitivity": rows}


def plan_nodes(pairs: list, how: dict, source, locate=None) -> tuple:
    """(``plan(node, weight)`` → its NodeQuantizer, what the report adds: the method, its
    calibration, mixed's sensitivities) for the MatMuls ``pairs`` as ``how`` asks."""
    weights, method, block = how["weights"], how["method"], how["block"]
    symmetric, level = how["symmetric"], how["level"]
    bits = 8 if weights == "int8" else 4
    extra: dict = {"method": method}
    if method in ASYMMETRIC_ONLY:
        if symmetric:
            logger.info(
                "--method %s: asymmetric by construction (%s)", method, ASYMMETRIC_ONLY[method]
            )
        extra["symmetric"] = False
    if method == "hqq" and level == 4:
        logger.info(
            "--method hqq: float zero points run at accuracy level 0 (ONNX Runtime's CPU kernel "
            "computes them with fp32 activations at level 4 too): its nodes say level 0"
        )
    modules = calibrator = None
    if method == "gptq" or weights == "mixed":
        if source is None:
            raise TfgraphError(f"--method {method} / --weights {weights} needs the eager model")
        windows = calibration_windows(source, how["text"], how["tokens"])
        modules = weight_modules(source, pairs, locate)
        extra["calibration"] = {
            "text": str(how["text"]),
            "tokens": tokens_of(windows),
            "windows": len(windows),
        }

    def quantizer(node, measuring: bool = False):
        chosen = "rtn" if measuring and method == "gptq" else method
        hessian = None
        if chosen == "gptq":
            hessian = lambda: calibrator.hessian(modules[node.name])  # noqa: E731
        return node_quantizer(chosen, bits, block, symmetric, level, hessian)

    eight: set[str] = set()
    if weights == "mixed":
        energies = Calibrator(source, windows, list(modules.values())).diagonals()
        measured = measure(
            pairs, modules, energies, lambda n, _w: quantizer(n, measuring=True), block
        )
        eight = choose(measured, how["share"])
        extra["mixed"] = report(measured, eight, how["share"])
    if method == "gptq":
        order = [modules[n.name] for n, _ in pairs if n.name not in eight]
        calibrator = Calibrator(source, windows, order)
        extra["calibration"]["passes"] = budget_groups(calibrator)
    int8 = rtn_quantizer(8, block, symmetric, level)
    # the slow methods' parts are held where all of them fit KEEP_BYTES (rtn is recomputed)
    keep = method != "rtn" and sum(w.const_value.size for _, w in pairs) // 2 <= KEEP_BYTES

    def plan(node, _weight):
        if node.name in eight:
            return int8
        spec = quantizer(node)
        return dataclasses.replace(spec, keep=keep)

    return plan, extra
