"""Per-tensor weight quantization methods (``--method``), each through ONNX Runtime's own routine,
and the one packing into ``MatMulNBits``' layout they all share.

A method takes one weight as its output rows, ``(N, K)`` fp32 (a ``Linear``'s parameter as
stored: each output column of the (K, N) MatMul weight is quantized on its own, so rows can be
taken a chunk at a time), and returns ``(packed, scales, zero_points)``:

- ``packed`` (N, blocks, blob) uint8, values low bits first, K padded with zeros to the block;
- ``scales`` (N, blocks), the weight's float type;
- ``zero_points``: ``None`` (symmetric: the kernel's 2^(bits−1)), (N, ceil(blocks·bits/8))
  uint8 packed per row like ``B``, or (N, blocks) floats of the scales' type (HQQ's).

The methods (ONNX Runtime 1.32, ``onnxruntime.quantization``):

- **rtn**: ``DefaultWeightOnlyQuantizer.qbits_block_quant`` (the C++ ``quantize_matmul_4bits``
  / ``_8bits``): round to nearest, scale from the block's range. Symmetric or asymmetric.
- **k_quant**: ``neural_compressor.weight_only.quant_tensor_k_quant_cpu``, as ``rtn_quantize(
  algorithm="k_quant")`` calls it: llama.cpp's k-quant search of scale and minimum (20 trial
  scales per block, weighted least squares). Zero points by construction (asymmetric only).
- **hqq**: ``HQQWeightOnlyQuantizer.quantize_internal``: half-quadratic optimization of the zero
  point (an lp-norm proximal solver, up to 20 iterations): *float* zero points (asymmetric
  only), which ``MatMulNBits`` takes in the scales' type. ONNX Runtime 1.32's CPU kernel runs
  them with fp32 activations whatever the accuracy level (measured: level 4 gives level 0's
  result to 1e-5), so HQQ nodes are written at level 0 and the reference follows; int4 only
  (the kernel refuses 8 bits with float zero points).
- **gptq**: ``neural_compressor.weight_only.gptq(W, H, …)`` with ``H`` the input Hessian
  (:mod:`tfgraph.exporters.ort.weights.calibration`), then ``quant_tensor(Q.T, …)`` as
  ``gptq_quantize`` does to put the result in blocks. 4 bits only (ONNX Runtime's
  ``gptq_quantize`` writes ``MatMulNBits`` for 4 bits only). Two repairs, each measured:
  ORT 1.32's error feedback reads the wrong half of its Cholesky factor (its GPTQ is round to
  nearest; :class:`_fixed_factor`), and its re-quantization leaves GPTQ's grid
  (:func:`_on_grid`).

ONNX Runtime's own packing of the last three (``make_matmul_weight_only_node``) packs 4-bit zero
points across row boundaries when the number of blocks is odd; :func:`pack` packs each row on
its own, as the kernel reads them (and as the C++ routine does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tfgraph.errors import TfgraphError
from tfgraph.exporters.ort.weights.packing import pack, padded

METHODS = ("rtn", "hqq", "k_quant", "gptq")
# what each costs, for the CLI's help and the refusals
COSTS = {
    "rtn": "round to nearest (seconds)",
    "hqq": "HQQ zero-point optimization, float zero points, no data (~2-5x rtn's time)",
    "k_quant": "llama.cpp's k-quant scale search, zero points, no data (~20x rtn's time)",
    "gptq": "GPTQ error feedback through the input Hessian: needs --calibration-text "
    "(a calibration pass, then K steps per weight)",
}
ASYMMETRIC_ONLY = {"hqq": "float zero points", "k_quant": "a zero point per block"}
FOUR_BITS_ONLY = {
    "gptq": "ONNX Runtime's gptq_quantize writes MatMulNBits for 4 bits only",
    "hqq": "ONNX Runtime's CPU MatMulNBits refuses 8-bit weights with float zero points",
}


@dataclass(frozen=True)
class GptqKnobs:
    """ONNX Runtime's ``gptq`` arguments beyond bits, group and scheme (its defaults)."""

    blocksize: int = 128
    percdamp: float = 0.01
    actorder: bool = False
    mse: bool = False
    perchannel: bool = True


def check_method(method: str, bits: int) -> None:
    """Refuse a method that cannot make ``bits``-bit weights, in one line. (hqq and k_quant are
    asymmetric by construction: ``--symmetric``, the default, does not apply to them.)"""
    if method not in METHODS:
        raise TfgraphError(f"unknown --method '{method}': choose one of {', '.join(METHODS)}")
    if bits == 8 and method in FOUR_BITS_ONLY:
        raise TfgraphError(
            f"--method {method} cannot make --weights int8 ({FOUR_BITS_ONLY[method]}): use "
            "--weights int4 or mixed, or --method rtn/k_quant for int8"
        )


def zero_point_kind(method: str, symmetric: bool) -> str | None:
    """What a method writes as zero points: None, ``"uint8"`` (packed) or ``"float"``."""
    if method == "hqq":
        return "float"
    if method == "k_quant" or not symmetric:
        return "uint8"
    return None


def k_quant(rows: np.ndarray, bits: int, block: int, dtype) -> tuple:
    from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor_k_quant_cpu

    n = rows.shape[0]
    q, scale, zp = quant_tensor_k_quant_cpu(padded(rows, block), bits, block)
    return pack(q.reshape(n, -1), scale.reshape(n, -1).astype(dtype), zp, bits, block)


def hqq(rows: np.ndarray, bits: int, block: int, dtype) -> tuple:
    import torch
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        HQQWeightOnlyQuantConfig,
        HQQWeightOnlyQuantizer,
    )

    quantizer = HQQWeightOnlyQuantizer(HQQWeightOnlyQuantConfig(block_size=block, bits=bits))
    q, scale, zero = quantizer.quantize_internal(
        torch.from_numpy(np.ascontiguousarray(rows, np.float32)), bits, group_size=block
    )
    n = rows.shape[0]
    scale = scale.numpy().reshape(n, -1).astype(dtype)
    return pack(
        q.numpy().reshape(n, -1), scale, zero.numpy().reshape(n, -1).astype(dtype), bits, block
    )


def gptq(
    rows: np.ndarray,
    hessian: np.ndarray,
    bits: int,
    block: int,
    symmetric: bool,
    dtype,
    knobs: GptqKnobs = GptqKnobs(),
) -> tuple:
    """GPTQ on the (K, N) weight ``rows.T`` with input Hessian ``hessian`` (K, K): ONNX Runtime's
    ``gptq`` with its error feedback repaired (:class:`_fixed_factor`), then put in blocks on
    its own grid (:func:`_on_grid`; ``gptq_quantize``'s ``quant_tensor`` leaves it)."""
    from onnxruntime.quantization.neural_compressor import weight_only

    scheme = "sym" if symmetric else "asym"
    w = np.array(rows.T, dtype=np.float32)  # gptq updates its arguments in place
    with _fixed_factor(weight_only):
        fake = weight_only.gptq(
            w,
            np.array(hessian, dtype=np.float64),
            num_bits=bits,
            group_size=block,
            scheme=scheme,
            blocksize=knobs.blocksize,
            percdamp=knobs.percdamp,
            actorder=knobs.actorder,
            mse=knobs.mse,
            perchannel=knobs.perchannel,
        )
    n = rows.shape[0]
    fake = padded(np.ascontiguousarray(fake.T), block)  # (N, K padded)
    q, scale, zp = _on_grid(fake, bits, block, symmetric)
    zp = None if symmetric else zp.reshape(n, -1).astype(np.uint8)
    return pack(q.reshape(n, -1), scale.reshape(n, -1).astype(dtype), zp, bits, block)


class _fixed_factor:  # noqa: N801 (a context manager used as a statement)
    """ONNX Runtime 1.32's ``gptq`` computes the upper Cholesky factor ``U`` of ``H⁻¹``
    (``cholesky(inv(H)).T``) but feeds each column's error back through ``U[i:, i]`` and
    ``U[i2:, i1:i2]``: zeros below the diagonal, so no error moves to the next columns and its
    result is round to nearest on GPTQ's grid (measured: the same ‖X(W−Q)‖ to 1e-8). The
    reference GPTQ reads ``U[i, i:]``, i.e. the lower factor ``Uᵀ`` at those indices: while
    the routine runs, its module's ``np.linalg.cholesky`` returns the factor transposed, so
    its own ``.T`` gives ``Uᵀ`` and the rest of its math runs as published."""

    def __init__(self, module) -> None:
        self.module = module

    def __enter__(self):
        self.saved = self.module.np
        self.module.np = _NumpyFixed()

    def __exit__(self, *exc) -> None:
        self.module.np = self.saved


class _LinalgFixed:
    def __getattr__(self, name):
        return getattr(np.linalg, name)

    @staticmethod
    def cholesky(a):
        return np.linalg.cholesky(a).T


class _NumpyFixed:
    linalg = _LinalgFixed()

    def __getattr__(self, name):
        return getattr(np, name)


def _on_grid(fake: np.ndarray, bits: int, block: int, symmetric: bool) -> tuple:
    """(q, scale, zero_point) per block of ``block`` values of GPTQ's output ``fake`` (N, K
    padded) that give back exactly its values: GPTQ puts each block on a grid ``s·(k − z)``,
    k in [0, 2^bits), that holds 0 (z = 2^(bits−1) symmetric); its step is (max − min)/m for
    the smallest m that fits. ``gptq_quantize``'s ``quant_tensor`` re-derives the step from the
    block's range instead, off GPTQ's grid wherever the block's values miss an end code
    (measured on a random 96x40: ‖X(W−Q)‖ 4% above GPTQ's own asymmetric, 30% symmetric).
    A block on no such grid (none measured) falls back to ``quant_tensor``."""
    from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor

    groups = fake.reshape(-1, block).astype(np.float64)
    top = 2**bits - 1
    low, high = groups.min(axis=1), groups.max(axis=1)
    tol = 1e-5 * np.maximum(np.abs(low), np.abs(high))
    q = np.zeros(groups.shape)
    scale, zero = np.ones(len(groups)), np.zeros(len(groups))
    done = np.zeros(len(groups), bool)
    for m in range(1, top + 1):
        if symmetric:  # k − z spans [−2^(bits−1), 2^(bits−1)): the step from the larger end
            step = np.maximum(-low / (top // 2 + 1), high / (top // 2)) * (top // 2 + 1) / m
        else:
            step = (high - low) / m
        step = np.where(step > 0, step, 1.0)
        k0 = np.round(-low / step)  # codes between 0 and the block's minimum
        z = k0 if not symmetric else np.full(len(groups), top // 2 + 1.0)
        codes = np.round(groups / step[:, None]) + z[:, None]
        fits = (np.abs((codes - z[:, None]) * step[:, None] - groups) <= tol[:, None]).all(axis=1)
        fits &= (codes >= 0).all(axis=1) & (codes <= top).all(axis=1) & ~done
        q[fits], scale[fits], zero[fits] = codes[fits], step[fits], z[fits]
        done |= fits
    if not done.all():
        scheme = "sym" if symmetric else "asym"
        q_off, s_off, z_off = quant_tensor(groups[~done], bits, block, scheme, "uint")
        q[~done], scale[~done], zero[~done] = q_off, s_off[:, 0], np.ravel(z_off)
    return q, scale, zero


def node_quantizer(
    method: str,
    bits: int,
    block: int,
    symmetric: bool,
    accuracy_level: int,
    hessian=None,
    knobs: GptqKnobs = GptqKnobs(),
):
    """The :class:`~tfgraph.exporters.ort.weights.nbits.NodeQuantizer` of one weight by
    ``method``; ``hessian()``: its input Hessian (gptq), asked for when the weight is written."""
    from tfgraph.exporters.ort.weights.nbits import NodeQuantizer, rtn_quantizer

    if method == "rtn":
        return rtn_quantizer(bits, block, symmetric, accuracy_level)

    def run(rows: np.ndarray) -> tuple:
        dtype = rows.dtype
        rows = np.asarray(rows, dtype=np.float32)
        if method == "k_quant":
            return k_quant(rows, bits, block, dtype)
        if method == "hqq":
            return hqq(rows, bits, block, dtype)
        return gptq(rows, hessian(), bits, block, symmetric, dtype, knobs)

    level = None
    if method == "hqq" and accuracy_level == 4:
        level = 0  # measured: the CPU kernel runs float zero points with fp32 activations
    return NodeQuantizer(bits, zero_point_kind(method, symmetric), run, method, level)
