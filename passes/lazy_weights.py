"""Weights derived from weights without reading them: transposes, packs and casts of
initializers as ``onnx_ir`` lazy tensors.

A checkpoint bound lazily (:mod:`tfgraph.sources.streamed`) keeps its weights on disk until the
artifact is written. A pass that needs a new weight computed from others (Q/K/V packed into one
matrix, a ``Gemm``'s weight transposed for ``MatMul``, a traced ``Transpose`` of a ``Linear``
weight folded) makes it a :func:`derived` tensor: its value is computed from its sources when
it is written, one tensor at a time, and never kept. The bytes are those the eager computation
gives (``np.concatenate``, ``np.transpose``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir

logger = logging.getLogger(__name__)


def tensor_of(value: ir.Value | None):
    """The constant tensor of an initializer or a ``Constant`` output (not read), or None."""
    return None if value is None else ir.convenience.get_const_tensor(value)


def derived(
    fn: Callable[..., np.ndarray],
    sources: Sequence,
    dtype: ir.DataType,
    shape: Sequence[int],
    name: str,
) -> ir.LazyTensor:
    """A tensor whose value is ``fn(*source arrays)``, computed each time it is read."""
    sources = tuple(sources)

    def compute() -> ir.Tensor:
        return ir.Tensor(np.ascontiguousarray(fn(*(s.numpy() for s in sources))), name=name)

    lazy = ir.LazyTensor(compute, dtype=dtype, shape=ir.Shape(list(shape)), name=name)
    return lazy


DERIVED = "tfgraph.derived"  # (op, argument, sources): how a derived weight was made


def register(graph: ir.Graph, name: str, tensor) -> ir.Value:
    """A new initializer holding ``tensor``, named ``name`` (suffixed until unique)."""
    unique, i = name, 0
    while unique in graph.initializers:
        i += 1
        unique = f"{name}_{i}"
    tensor.name = unique
    value = ir.Value(
        name=unique, const_value=tensor, shape=ir.Shape(list(tensor.shape)),
        type=ir.TensorType(tensor.dtype),
    )  # fmt: skip
    graph.register_initializer(value)
    return value


def concatenated(graph: ir.Graph, name: str, tensors: Sequence, axis: int) -> ir.Value:
    """``np.concatenate(tensors, axis)`` as a new lazy initializer."""
    shape = list(tensors[0].shape)
    shape[axis] = sum(t.shape[axis] for t in tensors)
    lazy = derived(lambda *a: np.concatenate(a, axis), tensors, tensors[0].dtype, shape, name)
    lazy.meta[DERIVED] = ("concat", axis, tuple(tensors))
    return register(graph, name, lazy)


def transposed(graph: ir.Graph, name: str, tensor, perm: Sequence[int] | None = None) -> ir.Value:
    """``np.transpose(tensor, perm)`` as a new lazy initializer."""
    perm = list(perm) if perm is not None else list(range(len(tensor.shape)))[::-1]
    shape = [tensor.shape[p] for p in perm]
    lazy = derived(lambda a: permuted(a, perm), [tensor], tensor.dtype, shape, name)
    lazy.meta[DERIVED] = ("transpose", tuple(perm), (tensor,))
    return register(graph, name, lazy)


_SAME_SIZE_INTS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def permuted(a: np.ndarray, perm: Sequence[int]) -> np.ndarray:
    """``np.ascontiguousarray(np.transpose(a, perm))``, the same bytes, copied by torch: its
    blocked copy is about 3x numpy's on a large weight (measured, a 5632 x 2048 fp32 matrix:
    39 ms against 119 ms), which is most of writing a transposed checkpoint. The bytes are
    moved as integers of the element's size, so any dtype (bf16 included) goes through."""
    import warnings

    import torch

    ints = _SAME_SIZE_INTS.get(a.dtype.itemsize)
    if ints is None or a.ndim < 2:
        return np.ascontiguousarray(np.transpose(a, perm))
    with warnings.catch_warnings():  # a read-only (memory-mapped) array: torch only reads it
        warnings.simplefilter("ignore")
        moved = torch.from_numpy(np.ascontiguousarray(a).view(ints)).permute(*perm).contiguous()
    return moved.numpy().view(a.dtype)


def fold_weight_transposes(model: ir.Model) -> int:
    """Every ``Transpose`` of a lazily bound initializer becomes a lazy initializer (constant
    folding would read the weight to fold it, or leave it unfolded past its size limit)."""
    graph = model.graph
    folded = 0
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        source = node.inputs[0]
        if source is None or not source.is_initializer():
            continue
        if not isinstance(source.const_value, ir.LazyTensor) or len(source.uses()) != 1:
            continue  # as constant folding: a table also read elsewhere (a tied head) stays
        out = node.outputs[0]
        perm = node.attributes.get_ints("perm", None)
        value = transposed(graph, f"{source.name}__t", source.const_value, perm)
        if out.is_graph_output():
            continue
        ir.convenience.replace_all_uses_with(out, value)
        graph.remove(node, safe=True)
        folded += 1
    logger.info("folded %d weight transposes lazily", folded)
    return folded
