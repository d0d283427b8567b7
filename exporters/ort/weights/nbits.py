"""``MatMul`` → ``com.microsoft.MatMulNBits``, one weight at a time, with ONNX Runtime's own
block quantization routine.

ONNX Runtime's ``MatMulNBitsQuantizer`` serializes the whole model, then loops over its MatMuls
calling ``DefaultWeightOnlyQuantizer.qbits_block_quant`` (the C++ ``quantize_matmul_4bits`` /
``quantize_matmul_8bits``) on each constant 2-D weight. This module makes the same nodes,
names and bytes in the ``onnx_ir`` graph itself: each new weight (packed ``B``, ``scales``,
``zero_points``) is a lazy tensor that quantizes its fp32 weight when it is written, so no
more than one weight is ever materialized, quantized or not (the three parts of one weight
share one quantization). Tested byte for byte against ``MatMulNBitsQuantizer`` on the zoo.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

from tfgraph.passes.lazy_weights import register

logger = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"


class _Blocks:
    """One weight's parts (packed, scales[, zero_points]), computed by ``compute()`` on the
    first read of any of them and dropped once all were read."""

    def __init__(self, compute, parts: int) -> None:
        self.compute = compute
        self.parts = parts
        self._value: tuple | None = None
        self._left: set[int] = set()

    def get(self, index: int) -> np.ndarray:
        if self._value is None:
            self._value = self.compute()
            self._left = set(range(self.parts))
        value = self._value[index]
        self._left.discard(index)
        if not self._left:
            self._value = None
        return value

    def lazy(self, index: int, dtype: ir.DataType, shape, name: str) -> ir.LazyTensor:
        def read() -> ir.Tensor:
            value = self.get(index)
            if dtype in (ir.DataType.INT4, ir.DataType.UINT4):  # packed two a byte
                return ir.PackedTensor(value, dtype, shape=ir.Shape(list(shape)), name=name)
            return ir.Tensor(value, name=name)

        return ir.LazyTensor(read, dtype=dtype, shape=ir.Shape(list(shape)), name=name)


COLUMN_CHUNK = 16384  # output columns quantized at a time from a transposed weight


def _block_quantized(quantizer, weight) -> tuple:
    """ONNX Runtime's (packed, scales, zero_points) of one (K, N) weight tensor.

    A ``Linear``'s weight is the lazy transpose of its (N, K) parameter: it is quantized
    :data:`COLUMN_CHUNK` output columns at a time from the parameter's rows (each column is
    quantized on its own, so the bytes are the same), never transposed whole — a 250k-word
    head held 4.1 GB twice, parameter and transposed copy."""
    from tfgraph.passes.lazy_weights import DERIVED

    made = weight.meta.get(DERIVED)
    if made is not None and made[0] == "transpose" and tuple(made[1]) == (1, 0):
        rows = made[2][0].numpy()  # (N, K)
        chunks = [
            _quantized(quantizer, rows[c : c + COLUMN_CHUNK].T)
            for c in range(0, rows.shape[0], COLUMN_CHUNK)
        ]
        del rows
        return tuple(
            None if parts[0] is None else np.concatenate(parts)
            for parts in zip(*chunks, strict=True)
        )
    return _quantized(quantizer, weight.numpy())


def _quantized(quantizer, array: np.ndarray) -> tuple:
    array = np.ascontiguousarray(array)  # the C++ routine reads it flat
    bfloat16 = array.dtype.name == "bfloat16"
    packed, scales, zp = quantizer.qbits_block_quant(
        array.astype(np.float32) if bfloat16 else array
    )
    if bfloat16:
        import ml_dtypes

        scales = scales.astype(ml_dtypes.bfloat16)
    return packed, scales, zp


def replace_node(graph: ir.Graph, node: ir.Node, new: ir.Node, weight: ir.Value) -> None:
    """Put ``new`` (one output) in ``node``'s place: its metadata, output name, shape and uses;
    ``weight`` (the constant it replaced) is dropped once nothing uses it."""
    new.metadata_props.update(dict(node.metadata_props))
    out = node.outputs[0]
    name, out.name = out.name, None
    new.outputs[0].name = name
    new.outputs[0].shape, new.outputs[0].type = out.shape, out.type
    graph.insert_before(node, new)
    out.replace_all_uses_with(new.outputs[0], replace_graph_outputs=True)
    graph.remove(node, safe=True)
    if not weight.uses() and not weight.is_graph_output():
        graph.initializers.pop(weight.name)


def quantize_matmuls(
    model: ir.Model,
    bits: int,
    *,
    block_size: int,
    symmetric: bool,
    accuracy_level: int,
    exclude: Iterable[str] = (),
) -> list[tuple[ir.Node, ir.Value]]:
    """Replace every standard ``MatMul`` of the main graph with a constant 2-D weight (except
    the nodes named in ``exclude``) by ``MatMulNBits``, as ``MatMulNBitsQuantizer`` does;
    ``(new node, the original weight)`` per MatMul replaced, in graph order."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    config = DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level, bits=bits
    )
    quantizer = DefaultWeightOnlyQuantizer(config)
    exclude = set(exclude)
    graph = model.graph
    done: list[tuple[ir.Node, ir.Value]] = []
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or node.name in exclude:
            continue
        weight = node.inputs[1]
        if weight is None or not weight.is_initializer() or weight.const_value is None:
            continue
        tensor = weight.const_value
        if len(tensor.shape) != 2:
            continue  # the N-D weights MatMulNBitsQuantizer reshapes do not occur in our graphs
        k, n = (int(d) for d in tensor.shape)
        blocks = (k + block_size - 1) // block_size
        kpack = 8 // bits
        blob = (block_size + kpack - 1) // kpack
        parts = 2 if symmetric else 3
        held = _Blocks(lambda t=tensor: _block_quantized(quantizer, t), parts)
        scale_dtype = ir.DataType.BFLOAT16 if tensor.dtype == ir.DataType.BFLOAT16 else tensor.dtype
        inputs = [
            node.inputs[0],
            register(
                graph,
                f"{weight.name}_Q{bits}",
                held.lazy(0, ir.DataType.UINT8, (n, blocks, blob), f"{weight.name}_Q{bits}"),
            ),
            register(
                graph,
                f"{weight.name}_scales",
                held.lazy(1, scale_dtype, (n, blocks), f"{weight.name}_scales"),
            ),
        ]
        if not symmetric:
            zp_shape = (n, (blocks + kpack - 1) // kpack)
            inputs.append(
                register(
                    graph,
                    f"{weight.name}_zero_points",
                    held.lazy(2, ir.DataType.UINT8, zp_shape, f"{weight.name}_zero_points"),
                )
            )
        attributes = {"K": k, "N": n, "bits": bits, "block_size": block_size}
        if accuracy_level:
            attributes["accuracy_level"] = accuracy_level
        new = ir.node(
            "MatMulNBits",
            inputs,
            attributes,
            domain=MS_DOMAIN,
            name=f"{node.name}_Q{bits}" if node.name else "",
        )
        replace_node(graph, node, new, weight)
        done.append((new, weight))
    if done:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    logger.info("quantized %d MatMul weights to %d bits (block %d)", len(done), bits, block_size)
    return done
