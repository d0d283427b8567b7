"""The weight a ``MatMulNBits`` node computes with, from its packed bytes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def dequantize(node: ir.Node, initializers, shape: tuple[int, int]) -> np.ndarray:
    """The (K, N) weight ``MatMulNBits`` computes with: ``(q − zero_point) · scale`` per block.

    Layout (ONNX Runtime's contrib op): ``B`` (N, blocks, block·bits/8) uint8, values packed
    low bits first; ``scales`` (N·blocks); ``zero_points`` packed the same way along blocks
    (uint8), or one float per block in the scales' type (HQQ's), or absent for symmetric
    weights (then 2^(bits−1)).
    """
    bits = node.attributes.get_int("bits", 4)
    block = node.attributes.get_int("block_size")
    packed = initializers[node.inputs[1].name].const_value.numpy()
    scales = initializers[node.inputs[2].name].const_value.numpy()
    zp_value = node.inputs[3] if len(node.inputs) > 3 else None
    zp = None
    if zp_value is not None and zp_value.name:
        zp = initializers[zp_value.name].const_value.numpy()
    return np.ascontiguousarray(dequantize_parts(packed, scales, zp, bits, block, shape[0]).T)


def dequantize_parts(packed, scales, zero_points, bits: int, block: int, k: int) -> np.ndarray:
    """(N, K) fp32 weight rows from ``MatMulNBits``' parts: ``(q − zero_point) · scale``."""
    n, blocks = packed.shape[0], packed.shape[1]
    scales = np.asarray(scales).astype(np.float32).reshape(n, blocks)
    q = _unpack(packed.reshape(n, -1), bits).reshape(n, blocks, block).astype(np.float32)
    if zero_points is None:
        zp = np.full((n, blocks), 2 ** (bits - 1), np.float32)
    elif np.issubdtype(zero_points.dtype, np.integer):
        zp = _unpack(zero_points.reshape(n, -1), bits)[:, :blocks].astype(np.float32)
    else:  # float zero points (HQQ's), one per block in the scales' type
        zp = zero_points.astype(np.float32).reshape(n, blocks)
    w = (q - zp[:, :, None]) * scales[:, :, None]  # (N, blocks, block)
    return w.reshape(n, -1)[:, :k]


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes → values of ``bits`` bits, low bits first, along the last axis."""
    if bits == 8:
        return packed
    low, high = packed & 0x0F, packed >> 4
    return np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)


ROW_CHUNK = 8192  # rows dequantized at a time: the temporaries stay a chunk's, not the matrix's


def dequantize_rows(node: ir.Node, initializers, rows: tuple[int, int] | None = None):
    """The same weight as :func:`dequantize`, transposed: (N, K) as a ``Linear`` holds it, a
    torch tensor (computed with torch's threads, no transposed copy; the same fp32 values).
    ``rows``: only the output rows ``[r0, r1)``. Computed :data:`ROW_CHUNK` rows at a time
    into the result, so the peak is the result and one chunk (a 250k-word head: 4.1 GB, where
    whole-matrix temporaries took three times that). The node's tensors are released after
    reading (an artifact's external data is not kept mapped)."""
    import torch

    bits = node.attributes.get_int("bits", 4)
    block = node.attributes.get_int("block_size")
    k, n = node.attributes.get_int("K"), node.attributes.get_int("N")
    r0, r1 = rows or (0, n)

    def read(value):
        tensor = initializers[value.name].const_value
        array = tensor.numpy()
        array = torch.from_numpy(
            np.array(array.reshape(n, -1)[r0:r1])
        )  # a copy: the mapping can go
        release = getattr(tensor, "release", None)
        if release is not None:
            release()
        return array

    packed = read(node.inputs[1])
    blocks = packed.shape[1] * 8 // (bits * block)
    scales = read(node.inputs[2]).float()
    zp_value = node.inputs[3] if len(node.inputs) > 3 else None
    zps = read(zp_value) if zp_value is not None and zp_value.name else None
    out = torch.empty((r1 - r0, k), dtype=torch.float32)
    for c0 in range(0, r1 - r0, ROW_CHUNK):
        c1 = min(c0 + ROW_CHUNK, r1 - r0)
        q = _unpack_torch(packed[c0:c1], bits).reshape(c1 - c0, blocks, block).float()
        if zps is not None and zps.is_floating_point():  # float zero points (HQQ's)
            zp = zps[c0:c1].float()
        elif zps is not None:
            zp = _unpack_torch(zps[c0:c1], bits)[:, :blocks].float()
        else:
            zp = torch.full((c1 - c0, blocks), float(2 ** (bits - 1)))
        w = (q - zp[:, :, None]) * scales[c0:c1, :, None]
        out[c0:c1] = w.reshape(c1 - c0, -1)[:, :k]
    return out


def _unpack_torch(packed, bits: int):
    import torch

    if bits == 8:
        return packed
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
