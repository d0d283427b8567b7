"""Give ONNX ``Attention`` (opset 23) a mask with a full query axis.

ONNX Runtime's ``Attention`` kernel rejects a mask that broadcasts over the query axis
(``attn_mask`` of shape (B, 1, 1, S) with Q of length T > 1: "inconsistent q_sequence_length";
KERNELS.md records the same limit for its contrib ops). torch.onnx exports
``scaled_dot_product_attention`` with a padding mask exactly that way at opset 23.

1. For any node ``Attention(Q, K, V, mask)`` whose 4-D mask has a static 1 in its query axis
   (dim −2) and whose Q is 4-D (B, H, T, d)::

       mask ─► Expand(mask, [1, 1, T, 1]) ─► Attention

   so the mask is (…, T, S). Broadcasting is what the op's specification means anyway; this
   only materializes it, at O(T·S) memory per batch entry, as the unfused graph did.
"""

from __future__ import annotations

import onnx_ir as ir

from tfgraph.passes.rewrite_utils import insert_tape


class ExpandAttentionMaskPass(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        count = 0
        for node in list(model.graph):
            if node.op_type != "Attention" or node.domain not in ("", "ai.onnx"):
                continue
            if len(node.inputs) < 4 or node.inputs[3] is None:
                continue
            q, mask = node.inputs[0], node.inputs[3]
            if mask.shape is None or len(mask.shape) != 4 or mask.shape[-2] != 1:
                continue
            if q.shape is None or len(q.shape) != 4:
                continue
            tape = ir.tape.Tape()
            seq = tape.op("Shape", [q], {"start": 2, "end": 3}, name=f"{node.name}_q_len")
            ones = tape.initializer(
                ir.tensor([1, 1], dtype=ir.DataType.INT64), name=f"{node.name}_mask_ones"
            )
            one = tape.initializer(
                ir.tensor([1], dtype=ir.DataType.INT64), name=f"{node.name}_mask_one"
            )
            shape = tape.op("Concat", [ones, seq, one], {"axis": 0})
            expanded = tape.op("Expand", [mask, shape])
            insert_tape(model.graph, node, tape)
            node.replace_input_with(3, expanded)
            count += 1
        return ir.passes.PassResult(model, modified=bool(count))
