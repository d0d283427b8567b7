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
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tfgraph.passes.lazy_weights import register

logger = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"
SHIPPED = "tfgraph.shipped"  # node meta: it holds a checkpoint's shipped integers


class _Blocks:
    """One weight's parts (packed, scales[, zero_points]), computed by ``compute()`` on the
    first read of any of them and dropped once all were read."""

    def __init__(self, compute, parts: int, keep: bool = False) -> None:
        self.compute = compute
        self.parts = parts
        self.keep = keep
        self._value: tuple | None = None
        self._left: set[int] = set()

    def get(self, index: int) -> np.ndarray:
        if self._value is None:
            self._value = self.compute()
            self._left = set(range(self.parts))
        value = self._value[index]
        self._left.discard(index)
        if not self._left and not self.keep:
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


@dataclass(frozen=True)
class NodeQuantizer:
    """How one MatMul weight is quantized (the per-node interface of :func:`quantize_matmuls`).

    ``quantize(rows)`` takes output rows of the weight, (n, K) in the weight's dtype (a chunk of
    the (K, N) MatMul weight transposed: every output column is quantized on its own), and
    returns ``MatMulNBits``' parts for them: ``packed`` (n, blocks, blob) uint8, ``scales``
    (n, blocks) and ``zero_points`` as ``zero_points`` says: ``None`` (none written),
    ``"uint8"`` ((n, ceil(blocks·bits/8)), packed per row) or ``"float"`` ((n, blocks), the
    scales' type). :mod:`tfgraph.exporters.ort.weights.methods` makes them for each method.
    ``accuracy_level``: the node's own, where the kernel cannot run the export's (``None``).
    ``keep``: hold the parts once computed (an export reads each weight up to three times:
    the step check, the eager reference, the save) where the method is slow and the model
    small; else they are computed again on each read, holding one weight at a time."""

    bits: int
    zero_points: str | None
    quantize: Callable[[np.ndarray], tuple]
    method: str = "rtn"
    accuracy_level: int | None = None
    keep: bool = False


def rtn_quantizer(bits: int, block_size: int, symmetric: bool, accuracy_level: int):
    """ONNX Runtime's round to nearest (``DefaultWeightOnlyQuantizer.qbits_block_quant``): the
    bytes of ``MatMulNBitsQuantizer``'s default."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    config = DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level, bits=bits
    )
    quantizer = DefaultWeightOnlyQuantizer(config)

    def run(rows: np.ndarray) -> tuple:
        packed, scales, zero_points = _quantized(quantizer, rows.T)
        return packed, scales, None if symmetric else zero_points  # the C++ routine fills them

    return NodeQuantizer(bits, None if symmetric else "uint8", run)


def _block_quantized(quantize, weight) -> tuple:
    """``quantize``'s (packed, scales, zero_points) of one (K, N) weight tensor.

    A ``Linear``'s weight is the lazy transpose of its (N, K) parameter: it is quantized
    :data:`COLUMN_CHUNK` output columns at a time from the parameter's rows (each column is
    quantized on its own, so the bytes are the same), never transposed whole — a 250k-word
    head held 4.1 GB twice, parameter and transposed copy."""
    rows = weight_rows(weight)
    chunks = [quantize(rows[c : c + COLUMN_CHUNK]) for c in range(0, rows.shape[0], COLUMN_CHUNK)]
    del rows
    if len(chunks) == 1:
        return chunks[0]
    return tuple(
        None if parts[0] is None else np.concatenate(parts) for parts in zip(*chunks, strict=True)
    )


def weight_rows(weight) -> np.ndarray:
    """The (N, K) output rows of a (K, N) weight tensor: a ``Linear``'s parameter as stored
    where the weight is its lazy transpose (no transposed copy), else a transposed view."""
    from tfgraph.passes.lazy_weights import DERIVED

    made = weight.meta.get(DERIVED)
    if made is not None and made[0] == "transpose" and tuple(made[1]) == (1, 0):
        return made[2][0].numpy()
    return weight.numpy().T


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


def quantizable(model: ir.Model, exclude: Iterable[str] = ()) -> list[tuple[ir.Node, ir.Value]]:
    """The standard ``MatMul`` nodes of the main graph with a constant 2-D weight, except those
    named in ``exclude``, and their weights, in graph order: what :func:`quantize_matmuls`
    replaces (the nodes ``MatMulNBitsQuantizer`` takes)."""
    exclude = set(exclude)
    found = []
    for node in model.graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or node.name in exclude:
            continue
        weight = node.inputs[1]
        if weight is None or not weight.is_initializer() or weight.const_value is None:
            continue
        if len(weight.const_value.shape) != 2:
            continue  # the N-D weights MatMulNBitsQuantizer reshapes do not occur in our graphs
        found.append((node, weight))
    return found


def _shipped(spec: NodeQuantizer | None, weight: ir.Value, block_size: int):
    """``spec``, or for a 4-bit weight read from an AWQ / GPTQ checkpoint the checkpoint's own
    integers, scales and zero points (:mod:`tfgraph.sources.quantized_checkpoint`: never
    quantized again)."""
    from tfgraph.sources.quantized_checkpoint import shipped_blocks, shipped_label

    if spec is None or spec.bits != 4:
        return spec
    from tfgraph.exporters.ort.weights.packing import pack, padded

    rows = shipped_blocks(weight.const_value, block_size)
    if rows is None:
        return spec

    def packed(chunk: np.ndarray) -> tuple:
        q, scales, zeros = rows(chunk)
        return pack(padded(q, block_size), scales, zeros, 4, block_size)

    return NodeQuantizer(4, "uint8", packed, shipped_label(weight.const_value))


def quantize_matmuls(
    model: ir.Model,
    bits: int,
    *,
    block_size: int,
    symmetric: bool,
    accuracy_level: int,
    exclude: Iterable[str] = (),
    plan: Callable[[ir.Node, ir.Value], NodeQuantizer | None] | None = None,
) -> list[tuple[ir.Node, ir.Value]]:
    """Replace every :func:`quantizable` ``MatMul`` by ``MatMulNBits``, as
    ``MatMulNBitsQuantizer`` does; ``(new node, the original weight)`` per MatMul replaced, in
    graph order. ``plan(node, weight)``: how each is quantized (its bits, zero points and
    routine; ``None`` keeps the MatMul); default: ONNX Runtime's round to nearest at ``bits``,
    ``symmetric`` as asked."""
    if plan is None:
        default = rtn_quantizer(bits, block_size, symmetric, accuracy_level)
        plan = lambda node, weight: default  # noqa: E731
    graph = model.graph
    done: list[tuple[ir.Node, ir.Value]] = []
    for node, weight in quantizable(model, exclude):
        spec = _shipped(plan(node, weight), weight, block_size)
        if spec is None:
            continue
        new = _nbits_node(graph, node, weight, spec, block_size, accuracy_level)
        new.meta[SHIPPED] = spec.method.endswith("checkpoint")
        replace_node(graph, node, new, weight)
        done.append((new, weight))
    if done:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    logger.info("quantized %d MatMul weights (block %d)", len(done), block_size)
    return done


def _nbits_node(graph, node, weight, spec: NodeQuantizer, block_size, accuracy_level) -> ir.Node:
    """The ``MatMulNBits`` node of ``node``, its weight's parts lazy (quantized when written)."""
    tensor, bits = weight.const_value, spec.bits
    k, n = (int(d) for d in tensor.shape)
    blocks = (k + block_size - 1) // block_size
    kpack = 8 // bits
    blob = (block_size + kpack - 1) // kpack
    parts = 2 if spec.zero_points is None else 3
    held = _Blocks(lambda t=tensor: _block_quantized(spec.quantize, t), parts, spec.keep)
    scale_dtype = ir.DataType.BFLOAT16 if tensor.dtype == ir.DataType.BFLOAT16 else tensor.dtype
    name = weight.name
    inputs = [
        node.inputs[0],
        register(
            graph,
            f"{name}_Q{bits}",
            held.lazy(0, ir.DataType.UINT8, (n, blocks, blob), f"{name}_Q{bits}"),
        ),
        register(graph, f"{name}_scales", held.lazy(1, scale_dtype, (n, blocks), f"{name}_scales")),
    ]
    if spec.zero_points == "uint8":
        zp_shape, zp_dtype = (n, (blocks + kpack - 1) // kpack), ir.DataType.UINT8
    elif spec.zero_points == "float":
        zp_shape, zp_dtype = (n, blocks), scale_dtype
    if spec.zero_points is not None:
        zp_name = f"{name}_zero_points"
        inputs.append(register(graph, zp_name, held.lazy(2, zp_dtype, zp_shape, zp_name)))
    attributes = {"K": k, "N": n, "bits": bits, "block_size": block_size}
    if spec.accuracy_level is not None:
        accuracy_level = spec.accuracy_level
    if accuracy_level:
        attributes["accuracy_level"] = accuracy_level
    return ir.node(
        "MatMulNBits",
        inputs,
        attributes,
        domain=MS_DOMAIN,
        name=f"{node.name}_Q{bits}" if node.name else "",
    )
