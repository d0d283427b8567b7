"""``Gemm`` with a constant weight as ``MatMul`` (+ ``Add``), for weight-only quantization.

ONNX Runtime's ``MatMulNBitsQuantizer`` takes ``MatMul`` nodes only. Hugging Face GPT-2's
``Conv1D`` multiplies through ``torch.addmm``, which traces to ``Gemm``: left alone, every
projection of the model would stay fp32 and only the LM head would be quantized.

1. For ``y = Gemm(A, B[, C])`` in the standard domain with ``B`` a constant 2-D weight,
   ``transA = 0``, ``alpha = 1`` and ``beta = 1`` (or no ``C``): ``y = MatMul(A, B')`` and,
   with ``C``, ``+ C``. ``B'`` is ``B``, or with ``transB = 1`` a transposed copy (a new
   initializer; the original stays for any other reader).

Everything else is left as it is. The products are the same (fp32 noise).
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from tfgraph.passes.lazy_weights import tensor_of, transposed
from tfgraph.passes.rewrite_utils import replace_value

logger = logging.getLogger(__name__)


def _plain(node: ir.Node) -> bool:
    """A Gemm this pass may rewrite: constant 2-D B, no transposed A, unit alpha and beta."""
    attrs = node.attributes
    has_c = len(node.inputs) > 2 and node.inputs[2] is not None
    return (
        node.op_type == "Gemm"
        and node.domain in ("", "ai.onnx")
        and attrs.get_int("transA", 0) == 0
        and attrs.get_float("alpha", 1.0) == 1.0
        and (not has_c or attrs.get_float("beta", 1.0) == 1.0)
        and (weight := tensor_of(node.inputs[1])) is not None
        and len(weight.shape) == 2
    )


def gemm_as_matmul(model: ir.Model) -> int:
    """Rewrite the plain Gemms of ``model``'s main graph; how many."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if not _plain(node):
            continue
        weight = node.inputs[1]
        if node.attributes.get_int("transB", 0):
            weight = transposed(graph, f"{weight.name}__kn", tensor_of(weight))
        matmul = ir.node("MatMul", [node.inputs[0], weight], name=f"{node.name}__matmul")
        new = [matmul]
        out = matmul.outputs[0]
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            add = ir.node("Add", [out, node.inputs[2]], name=f"{node.name}__bias")
            new.append(add)
            out = add.outputs[0]
        for n in new:
            n.metadata_props.update(node.metadata_props)
        out.shape, out.type = node.outputs[0].shape, node.outputs[0].type
        graph.insert_before(node, new)
        replace_value(node.outputs[0], out)
        graph.remove(node, safe=True)
        count += 1
    if count:
        logger.info("%d Gemm node(s) rewritten as MatMul for the quantizer", count)
    return count
