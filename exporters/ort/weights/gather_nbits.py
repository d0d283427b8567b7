"""Embedding ``Gather`` → ``com.microsoft.GatherBlockQuantized`` (int4), one table at a time,
with ONNX Runtime's own routine.

``MatMulNBitsQuantizer`` quantizes a ``Gather`` when it is among the op types asked for: each
table row is cut into blocks of ``block_size`` along the hidden axis, one scale (and,
asymmetric, one zero point) per block, through ``DefaultWeightOnlyQuantizer.quantize_ndarray``;
only 4 bits. This module makes the same node in the ``onnx_ir`` graph, its three parts lazy
(quantized when written, as :mod:`tfgraph.exporters.ort.weights.nbits` does for MatMuls).

Only embeddings are taken: a ``Gather`` traced from ``aten.embedding`` on a constant 2-D
fp32/fp16 table, along axis 0. Rotary tables and other gathered constants are left as they are.
An embedding is where an int4 artifact's remaining fp32 bytes were (32000 x 2048 x 4 = 262 MB
of a 1.1B Llama's 0.86 GB), and a decode step reads one row of it.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from tfgraph.exporters.ort.weights.nbits import MS_DOMAIN, _Blocks, replace_node
from tfgraph.passes.lazy_weights import register

logger = logging.getLogger(__name__)

_TABLE_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)  # the CPU kernel's scale types


def is_embedding(node: ir.Node) -> bool:
    """A ``Gather`` of a constant 2-D float table along axis 0, traced from ``aten.embedding``."""
    if node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
        return False
    table = node.inputs[0]
    if table is None or not table.is_initializer() or table.const_value is None:
        return False
    tensor = table.const_value
    if len(tensor.shape) != 2 or tensor.dtype not in _TABLE_DTYPES:
        return False
    if node.attributes.get_int("axis", 0) != 0:
        return False
    return "aten.embedding" in node.metadata_props.get("pkg.torch.onnx.fx_node", "")


_ZERO_BLOCKS_SAID: set[str] = set()  # tables whose all-zero blocks were logged (once each)


def _quantized(tensor, block_size: int, symmetric: bool) -> tuple:
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    data = tensor.numpy()
    # ONNX Runtime's quant_slice_(a)symmetric divide every block by its scale before np.where
    # drops the blocks whose scale is 0 (all zeros: a padding row); numpy's RuntimeWarnings
    # about those discarded values (one per read of the lazy table) stay out of the output
    with np.errstate(divide="ignore", invalid="ignore"):
        chunks = [  # rows quantize on their own: the same bytes, temporaries of 8192 rows
            DefaultWeightOnlyQuantizer.quantize_ndarray(
                np.ascontiguousarray(data[r : r + TABLE_CHUNK]), 1, block_size, symmetric
            )
            for r in range(0, data.shape[0], TABLE_CHUNK)  # even rows: packing stays aligned
        ]
    parts = tuple(None if p[0] is None else np.concatenate(p) for p in zip(*chunks, strict=True))
    zero = int((parts[1] == 0).sum())
    if zero and tensor.name not in _ZERO_BLOCKS_SAID:
        _ZERO_BLOCKS_SAID.add(tensor.name)
        logger.debug("%s: %d all-zero blocks (scale 0, quantized to 0)", tensor.name, zero)
    return parts


def quantize_embeddings(
    model: ir.Model, *, block_size: int, symmetric: bool
) -> list[tuple[ir.Node, ir.Value]]:
    """Replace each embedding ``Gather`` (:func:`is_embedding`) of the main graph by an int4
    ``GatherBlockQuantized``; ``(new node, the original table)`` per table, in graph order."""
    graph = model.graph
    done: list[tuple[ir.Node, ir.Value]] = []
    data_type = ir.DataType.INT4 if symmetric else ir.DataType.UINT4
    for node in list(graph):
        if not is_embedding(node):
            continue
        table = node.inputs[0]
        tensor = table.const_value
        rows, width = (int(d) for d in tensor.shape)
        blocks = (width + block_size - 1) // block_size
        held = _Blocks(lambda t=tensor: _quantized(t, block_size, symmetric), 2 if symmetric else 3)
        inputs = [
            register(
                graph,
                f"{table.name}_Q4",
                held.lazy(0, data_type, (rows, width), f"{table.name}_Q4"),
            ),
            node.inputs[1],
            register(
                graph,
                f"{table.name}_scales",
                held.lazy(1, tensor.dtype, (rows, blocks), f"{table.name}_scales"),
            ),
        ]
        if not symmetric:
            name = f"{table.name}_zero_points"
            inputs.append(register(graph, name, held.lazy(2, data_type, (rows, blocks), name)))
        new = ir.node(
            "GatherBlockQuantized",
            inputs,
            {"gather_axis": 0, "quantize_axis": 1, "block_size": block_size},
            domain=MS_DOMAIN,
            name=f"{node.name}_Q4" if node.name else "",
        )
        replace_node(graph, node, new, table)
        done.append((new, table))
    if done:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    logger.info("quantized %d embedding tables to 4 bits (block %d)", len(done), block_size)
    return done


TABLE_CHUNK = 8192  # rows dequantized at a time


def dequantize_table(node: ir.Node, initializers, rows=None) -> np.ndarray:
    """The (rows, width) fp32 table ``GatherBlockQuantized`` reads from: ``(q − zero_point) ·
    scale`` per block (signed int4 data has zero point 0; unsigned without zero points, 8).
    ``rows``: only those rows (token ids), read from the stored bytes without unpacking the
    rest (the reference's embedding of a 250k-word table: a prompt's rows, not 4.1 GB)."""
    data = initializers[node.inputs[0].name].const_value
    count, width = (int(d) for d in data.shape)
    picked = np.arange(count) if rows is None else np.asarray(rows, np.int64)
    q = _table_rows(data, picked, width)
    scales = initializers[node.inputs[2].name].const_value.numpy().reshape(count, -1)
    block = node.attributes.get_int("block_size")
    zp_value = node.inputs[3] if len(node.inputs) > 3 else None
    if zp_value is not None and zp_value.name:
        zp = initializers[zp_value.name].const_value.numpy().reshape(count, -1)
    else:
        zp = np.full(scales.shape, 0.0 if data.dtype == ir.DataType.INT4 else 8.0, np.float32)
    out = np.empty((len(picked), width), np.float32)
    for r0 in range(0, len(picked), TABLE_CHUNK):  # the temporaries stay a chunk's
        at = picked[r0 : r0 + TABLE_CHUNK]
        full = lambda a: np.repeat(a[at].astype(np.float32), block, axis=1)[:, :width]  # noqa: E731, B023
        out[r0 : r0 + len(at)] = (q[r0 : r0 + len(at)].astype(np.float32) - full(zp)) * full(scales)
    return out


def _table_rows(data, rows: np.ndarray, width: int) -> np.ndarray:
    """The int4 values of ``rows`` of a (count, width) table: from its stored bytes where it
    is written to a file (two values a byte, low first; no unpacked copy of the whole table is
    made or kept), else from its values."""
    if not isinstance(data, ir.ExternalTensor) or width % 2:
        return np.asarray(data.numpy()).reshape(-1, width)[rows]
    packed = np.memmap(data.path, np.uint8, mode="r", offset=data.offset or 0, shape=data.nbytes)
    picked = packed.reshape(-1, width // 2)[rows]
    values = np.stack([picked & 0x0F, picked >> 4], axis=-1).reshape(len(rows), width)
    if data.dtype == ir.DataType.INT4:  # two's complement in four bits
        values = (values.astype(np.int8) ^ 8) - 8
    return values
