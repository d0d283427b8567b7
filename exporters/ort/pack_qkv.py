"""``ort`` target: one packed Q/K/V projection per ``GroupQueryAttention``.

When a GQA node's query, key and value are ``MatMul(x, W_q)``, ``MatMul(x, W_k)`` and
``MatMul(x, W_v)`` of the same ``x`` with constant weights (optionally each plus a constant
bias), and nothing else reads them, the three become one ``MatMul(x, [W_q | W_k | W_v])``
(and one bias ``Add``) feeding the kernel's packed-QKV form: ``query`` of width
(Hq + 2·Hkv)·d, ``key`` and ``value`` empty. One GEMM instead of three at every step, which
is what onnxruntime-genai's model builder writes. Q, K and V that are the three outputs of
one last-axis ``Split`` (GPT-2's ``c_attn``) are fed as the tensor before the split. Q, K and
V must share the head size (the packed form's requirement); otherwise the node is left as it
is.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from tfgraph.exporters.ort.ops import MS_DOMAIN
from tfgraph.passes.lazy_weights import concatenated, tensor_of
from tfgraph.passes.rewrite_utils import constant

logger = logging.getLogger(__name__)


def _projection(value: ir.Value | None, user: ir.Node):
    """(x, W, bias or None, the nodes) for ``[Add(] MatMul(x, W) [, b)]`` read only by ``user``."""
    if value is None or len(value.uses()) != 1 or value.is_graph_output():
        return None
    node = value.producer()
    bias = None
    nodes = []
    if node is not None and node.op_type == "Add" and node.domain in ("", "ai.onnx"):
        for a, b in (node.inputs, reversed(node.inputs)):
            c = tensor_of(b)
            if c is not None and len(c.shape) == 1 and a.producer() is not None:
                bias, value, nodes = c, a, [node]
                break
        else:
            return None
        if len(value.uses()) != 1:
            return None
        node = value.producer()
    if node is None or node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return None
    weight = tensor_of(node.inputs[1])  # not read: a checkpoint's weight stays on disk
    if weight is None or len(weight.shape) != 2:
        return None
    return node.inputs[0], weight, bias, [node, *nodes]


def _split_source(node: ir.Node) -> ir.Value | None:
    """The packed tensor when Q, K and V are the three outputs of one last-axis ``Split``
    read only by this node, with the packed form's widths."""
    q, k, v = node.inputs[:3]
    split = q.producer()
    if split is None or split.op_type != "Split" or split.domain not in ("", "ai.onnx"):
        return None
    if list(split.outputs) != [q, k, v] or any(len(x.uses()) != 1 for x in (q, k, v)):
        return None
    source = split.inputs[0]
    if source is None or source.shape is None or len(source.shape) != 3:
        return None
    if split.attributes.get_int("axis", 0) not in (-1, 2):
        return None
    sizes = constant(split.inputs[1]) if len(split.inputs) > 1 else None
    heads = node.attributes.get_int("num_heads", 0)
    kv_heads = node.attributes.get_int("kv_num_heads", 0)
    width = source.shape[2]
    if not isinstance(width, int) or not heads or not kv_heads:
        return None
    if sizes is not None:
        sizes = [int(x) for x in sizes.reshape(-1)]
    elif split.attributes.get_int("num_outputs", 0) == 3 and width % 3 == 0:
        sizes = [width // 3] * 3  # equal parts (opset 18's num_outputs)
    else:
        return None
    head = sizes[0] // heads if sizes[0] % heads == 0 else 0
    if not head or sizes != [heads * head, kv_heads * head, kv_heads * head]:
        return None
    return source if sum(sizes) == width else None


class PackQKVPass(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        packed = 0
        for node in list(model.graph):
            if node.domain == MS_DOMAIN and node.op_type == "GroupQueryAttention":
                packed += self._pack(model.graph, node)
        if packed:
            logger.info("packed Q/K/V projections into one MatMul for %d attention layers", packed)
        return ir.passes.PassResult(model, modified=bool(packed))

    def _pack(self, graph: ir.Graph, node: ir.Node) -> int:
        if len(node.inputs) < 3 or any(v is None for v in node.inputs[:3]):
            return 0
        packed = _split_source(node)
        if packed is not None:  # GPT-2's c_attn: already one projection, split in three
            node.replace_input_with(0, packed)
            node.replace_input_with(1, None)
            node.replace_input_with(2, None)
            return 1
        parts = [_projection(v, node) for v in node.inputs[:3]]
        if any(p is None for p in parts):
            return 0
        (xq, wq, bq, _), (xk, wk, bk, _), (xv, wv, bv, _) = parts
        if not (xq is xk is xv):
            return 0
        if len({bq is None, bk is None, bv is None}) != 1:
            return 0
        if (
            len({w.dtype for w in (wq, wk, wv)}) != 1
            or len({w.shape[0] for w in (wq, wk, wv)}) != 1
        ):
            return 0
        heads = node.attributes.get_int("num_heads", 0)
        kv_heads = node.attributes.get_int("kv_num_heads", 0)
        if not heads or not kv_heads or wq.shape[1] % heads or wk.shape[1] % kv_heads:
            return 0
        head = wq.shape[1] // heads
        if wk.shape[1] != kv_heads * head or wv.shape[1] != kv_heads * head:
            return 0  # the packed form needs one head size for Q, K and V
        prefix = node.name or "gqa"
        weight = concatenated(graph, f"{prefix}_qkv_weight", [wq, wk, wv], 1)
        matmul = ir.node("MatMul", [xq, weight], name=f"{prefix}_qkv")
        graph.insert_before(node, matmul)
        out = matmul.outputs[0]
        if bq is not None:
            bias = concatenated(graph, f"{prefix}_qkv_bias", [bq, bk, bv], 0)
            add = ir.node("Add", [out, bias], name=f"{prefix}_qkv_bias")
            graph.insert_before(node, add)
            out = add.outputs[0]
        source = node.inputs[0]
        out.type = source.type
        if source.shape is not None and len(source.shape) == 3:
            out.shape = ir.Shape([source.shape[0], source.shape[1], wq.shape[1] + 2 * wk.shape[1]])
        for new in (matmul, *([add] if bq is not None else [])):
            meta = parts[0][3][0].metadata_props
            new.metadata_props.update(dict(meta))
        node.replace_input_with(0, out)
        node.replace_input_with(1, None)
        node.replace_input_with(2, None)
        return 1
