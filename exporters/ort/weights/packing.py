"""``MatMulNBits``' layout of integer weights: every method's (and an AWQ/GPTQ checkpoint's
shipped) integers, scales and zero points packed the one way the kernel reads them; zero
points packed per row (ONNX Runtime's ``make_matmul_weight_only_node`` packs them across rows
when a row has an odd number of blocks)."""

from __future__ import annotations

import numpy as np


def pack(q: np.ndarray, scales: np.ndarray, zero_points, bits: int, block: int) -> tuple:
    """``MatMulNBits``' (packed, scales, zero_points) from integer values ``q`` (N, K padded to
    the block, in [0, 2^bits)), ``scales`` (N, blocks) and integer zero points (N, blocks;
    packed per row) or float ones (returned as they are) or ``None``."""
    n = q.shape[0]
    blocks = q.shape[1] // block
    q = q.astype(np.uint8)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    packed = np.ascontiguousarray(q.reshape(n, blocks, block * bits // 8))
    scales = np.ascontiguousarray(scales.reshape(n, blocks))
    if zero_points is None or np.issubdtype(np.asarray(zero_points).dtype, np.floating):
        return packed, scales, zero_points
    zp = np.asarray(zero_points).reshape(n, blocks).astype(np.uint8)
    if bits == 4:
        if blocks % 2:  # each row padded on its own (the pad is never read)
            zp = np.concatenate([zp, np.full((n, 1), 8, np.uint8)], axis=1)
        zp = zp[:, 0::2] | (zp[:, 1::2] << 4)
    return packed, scales, np.ascontiguousarray(zp)


def padded(rows: np.ndarray, block: int) -> np.ndarray:
    """(N, K) → (N, K padded with zeros to a multiple of ``block``), as ``pad_tensor`` does."""
    pad = -rows.shape[1] % block
    return np.pad(rows, ((0, 0), (0, pad))) if pad else rows
