"""``ort`` target: turn the KV cache into preallocated buffers that past and present share.

After lowering, each cached layer is a ``GroupQueryAttention`` reading its ``past_key`` /
``past_value`` inputs (roles, :mod:`tfgraph.contract`) in its past slots. ONNX Runtime's
kernel writes the new keys and values in place when ``present_*`` is bound to the same buffer
as ``past_*`` (onnxruntime-genai's layout), so a
decode step never copies the cache. The buffer is longer than the past, so the past length
can no longer be read off the past's shape; this pass

- adds the input ``past_sequence_length`` (role ``past_length``; int64, shape [1]) and feeds
  it wherever the graph read ``Shape(past)[2]`` (positions, masks, GQA's sequence lengths);
- renames the buffers' length axis ``max_sequence`` (inputs and present outputs), and records
  the layout (model metadata ``tfgraph.kv_buffer = shared``; ``manifest.json`` ``kv_layout``).

The cache stays copying unless every use of every past input is a GQA past slot or that
``Shape``: e.g. a layer lowered to ``MultiHeadAttention`` (head size not a multiple of 8) keeps
its ``Concat``, and the artifact keeps the copying cache. The dead cache ``Concat`` nodes that
lowering left are removed first either way, so ``modified`` is True whenever any were.
"""

from __future__ import annotations

import logging

import onnx_ir as ir
import onnx_ir.passes.common as common

from tfgraph import contract
from tfgraph.passes.cache.row_lengths import expose_row_lengths
from tfgraph.passes.canonical import require_lowered_attention

logger = logging.getLogger(__name__)


def _is_length_shape(node: ir.Node) -> bool:
    return (
        node.op_type == "Shape"
        and node.attributes.get_int("start", 0) == 2
        and node.attributes.get_int("end", -1) == 3
    )


def _is_gqa_past(node: ir.Node, index: int) -> bool:
    return (
        node.domain == "com.microsoft"
        and node.op_type == "GroupQueryAttention"
        and index
        in (
            3,
            4,
        )
    )


class ShareKVBufferPass(ir.passes.InPlacePass):
    def requires(self, model: ir.Model) -> None:
        require_lowered_attention(
            model, self, "the shared KV buffer (GroupQueryAttention)", "LowerAttentionPass"
        )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = set(contract.names_with_role(model, contract.PAST_KEY, contract.PAST_VALUE))
        pasts = [v for v in graph.inputs if v.name in names]
        if not pasts or contract.names_with_role(model, contract.PAST_LENGTH):
            return ir.passes.PassResult(model, modified=False)
        if contract.names_with_role(model, contract.PAST_TOKENS):
            logger.info("KV cache stays copying: cached token values (an indexer's keys) grow too")
            return ir.passes.PassResult(model, modified=False)
        # the cache Concats lowering made dead: removed even where the cache stays copying
        removed = common.RemoveUnusedNodesPass()(model).modified
        shapes, gqa = [], []
        for past in pasts:
            for use in past.uses():
                node, index = use.node, use.idx
                if _is_length_shape(node):
                    shapes.append(node)
                elif _is_gqa_past(node, index):
                    gqa.append(node)
                else:
                    logger.info("KV cache stays copying: %s is read by %s", past.name, node.op_type)
                    return ir.passes.PassResult(model, modified=removed)
        length = ir.Value(
            name=contract.PAST_LENGTH_NAME,
            type=ir.TensorType(ir.DataType.INT64),
            shape=ir.Shape([1]),
        )
        graph.inputs.append(length)
        contract.set_role(model, contract.PAST_LENGTH_NAME, contract.PAST_LENGTH)
        for node in shapes:
            node.outputs[0].replace_all_uses_with(length)
            graph.remove(node, safe=True)
        for past in pasts:
            past.shape = ir.Shape([*past.shape[:2], contract.BUFFER_DIM, *past.shape[3:]])
        for node in set(gqa):
            for present in node.outputs[1:3]:
                if present.shape is not None and len(present.shape) == 4:
                    present.shape = ir.Shape(
                        [*present.shape[:2], contract.BUFFER_DIM, present.shape[3]]
                    )
        model.metadata_props[contract.KV_LAYOUT_KEY] = "shared"  # the layout, for the manifest
        expose_row_lengths(model)
        logger.info("KV cache: %d buffers shared by past and present", len(pasts))
        return ir.passes.PassResult(model, modified=True)
