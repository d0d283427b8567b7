"""The weight a ``MatMulNBits`` node computes with, from its packed bytes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def dequantize(node: ir.Node, initializers, shape: tuple[int, int]) -> np.ndarray:
    """The (K, N) weight ``MatMulNBits`` computes with: ``(q − zero_point) · scale`` per block.

    Layout (ONNX Runtime's contrib op): ``B`` (N, blocks, block·bits/8) uint8, values packed
    low bits first; ``scales`` (N·blocks); ``zero_points`` packed the same way along blocks,
    absent for symmetric weights (then 2^(bits−1)).
    """
    bits = node.attributes.get_int("bits", 4)
    block = node.attributes.get_int("block_size")
    k, n = shape
    packed = initializers[node.inputs[1].name].const_value.numpy()
    scales = initializers[node.inputs[2].name].const_value.numpy().astype(np.float32)
    blocks = packed.shape[1]
    q = _unpack(packed.reshape(n, -1), bits).reshape(n, blocks, block).astype(np.float32)
    zp_value = node.inputs[3] if len(node.inputs) > 3 else None
    if zp_value is not None and zp_value.name:
        zp = initializers[zp_value.name].const_value.numpy()
        zp = _unpack(zp.reshape(n, -1), bits)[:, :blocks].astype(np.float32)
    else:
        zp = np.full((n, blocks), 2 ** (bits - 1), np.float32)
    w = (q - zp[:, :, None]) * scales.reshape(n, blocks)[:, :, None]  # (N, blocks, block)
    return np.ascontiguousarray(w.reshape(n, -1)[:, :k].T)  # (K, N)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes → values of ``bits`` bits, low bits first, along the last axis."""
    if bits == 8:
        return packed
    low, high = packed & 0x0F, packed >> 4
    return np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)


def dequantize_rows(node: ir.Node, initializers):
    """The same weight as :func:`dequantize`, transposed: (N, K) as a ``Linear`` holds it, a
    torch tensor (computed with torch's threads, no transposed copy; the same fp32 values).
    The node's tensors are released after reading (an artifact's external data is not kept
    mapped)."""
    import torch

    bits = node.attributes.get_int("bits", 4)
    block = node.attributes.get_int("block_size")
    k, n = node.attributes.get_int("K"), node.attributes.get_int("N")

    def read(value):
        tensor = initializers[value.name].const_value
        array = torch.from_numpy(np.array(tensor.numpy()))  # a copy: the mapping can go
        release = getattr(tensor, "release", None)
        if release is not None:
            release()
        return array

    packed = read(node.inputs[1])
    scales = read(node.inputs[2]).float()
    blocks = packed.shape[1]
    q = _unpack_torch(packed.reshape(n, -1), bits).reshape(n, blocks, block).float()
    zp_value = node.inputs[3] if len(node.inputs) > 3 else None
    if zp_value is not None and zp_value.name:
        zp = _unpack_torch(read(zp_value).reshape(n, -1), bits)[:, :blocks].float()
    else:
        zp = torch.full((n, blocks), float(2 ** (bits - 1)))
    w = (q - zp[:, :, None]) * scales.reshape(n, blocks)[:, :, None]
    return w.reshape(n, -1)[:, :k].contiguous()


def _unpack_torch(packed, bits: int):
    import torch

    if bits == 8:
        return packed
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
