"""``onnx`` and ``tensorrt`` targets: a static, standard-ONNX KV cache written in place.

After lowering, a cached layer of these targets reads ``present = Concat(past, new)`` (the
copying cache: every step copies the whole past, a cost that grows with it). This pass makes
each past a preallocated buffer of a fixed capacity that past and present share:

1. ``present = TensorScatter(past, new, write_indices)`` (opset 24, ``axis = −2``): the new
   keys/values written at the past length of each row; the graph's opset becomes 24.
2. A new input ``past_sequence_length`` (role ``past_length``, int64 [1]) is the sequence
   axis of every ``Shape(past)`` read, and ``past_sequence_length + Shape(new)[2]`` that of
   every ``Shape(present)`` read (the total length masks and positions are built for); the
   write indices are the past length for every row.
3. The attention now reads all ``C`` buffer positions. The bias or mask it adds, built for
   the ``L = past + new`` valid keys, is padded along the key axis to ``C`` with ``−inf``
   (``False`` for a boolean mask), so positions past the valid ones get no weight: the
   ``attn_mask`` of an ``Attention`` reading the buffer (``onnx``), the ``Add`` before the
   ``Softmax`` of the decomposed ``MatMul-Softmax-MatMul`` (``tensorrt``). A layer with no
   bias gets the padding mask alone.
4. Buffers' length axis is ``max_sequence``; the layout is recorded as ``static`` (model
   metadata ``tfgraph.kv_buffer``; ``manifest.json`` ``kv_layout``): the runner binds present
   to the past's buffer (ONNX Runtime's ``TensorScatter`` then writes in place) and feeds the
   past length. Values computed from a buffer lose the shapes that name the copying cache's
   total length (that axis is the capacity now; ONNX Runtime sized buffers by the stale name).

A step's cost is then flat in the past length (the attention scores all C positions). The
cache stays copying unless every use of every past input is that ``Concat`` or a ``Shape``
and every attention over a buffer is found with its scores' key axis last (an attention sink
concatenated to the scores keeps the copying cache; logged). The nodes lowering left dead are
removed first either way, so ``modified`` is True whenever any were.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common

from tfgraph import contract
from tfgraph.passes.cache.row_lengths import expose_row_lengths, row_lengths_value
from tfgraph.passes.canonical import require_lowered_attention
from tfgraph.passes.rewrite_utils import insert_tape, replace_value

logger = logging.getLogger(__name__)

SCATTER_OPSET = 24
_WALK = 8  # nodes from a buffer to its Softmax (GQA's head repeat, transposes, scaling)
# what may compute unbiased scores right before the Softmax (the key axis last, C long)
_SCORE_OPS = ("MatMul", "Mul", "Div", "Tanh")


def _standard(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _base(node: ir.Node) -> str:
    """A name prefix for what a rewrite adds around ``node`` (unnamed nodes get a unique one)."""
    return node.name or f"{node.op_type}_{id(node):x}"


def _is_shape(node: ir.Node) -> bool:
    return _standard(node, "Shape")


def _shape_with_length(tape: ir.tape.Tape, like: ir.Value, length: ir.Value) -> ir.Value:
    """``Shape(like)`` with its sequence axis (2) replaced by ``length``."""
    head = tape.op("Shape", [like], {"start": 0, "end": 2})
    tail = tape.op("Shape", [like], {"start": 3})
    return tape.op("Concat", [head, length, tail], {"axis": 0})


def _shape_reads(value: ir.Value) -> list[ir.Node]:
    return [use.node for use in value.uses() if _is_shape(use.node)]


def _reroute_shapes(tape, value: ir.Value, reads: list[ir.Node], vector: ir.Value) -> None:
    """Each ``Shape(value[, start, end])`` of ``reads`` reads ``vector[start:end]`` instead
    (remove them once the tape is inserted)."""
    for i, node in enumerate(reads):
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", None)
        if start == 0 and end is None:
            out = vector
        else:
            stop = end if end is not None else 2**62
            starts = tape.initializer(
                ir.tensor(np.array([start], np.int64)), name=f"{value.name}_shape{i}_s"
            )
            ends = tape.initializer(
                ir.tensor(np.array([stop], np.int64)), name=f"{value.name}_shape{i}_e"
            )
            out = tape.op("Slice", [vector, starts, ends])
        node.outputs[0].replace_all_uses_with(out)


def _is_cache_concat(node: ir.Node, index: int) -> bool:
    axis = node.attributes.get_int("axis", 0) if _standard(node, "Concat") else None
    return (
        axis in (2, -2)
        and index == 0
        and len(node.inputs) == 2
        and node.outputs[0].is_graph_output()
    )


def _attention_bias_slot(present: ir.Value) -> tuple[ir.Node, int] | None:
    """Where the scores over ``present``'s positions get their bias: (node, input index of the
    bias, or −1 when there is none and one must be added before that Softmax)."""
    frontier, seen = [present], set()
    for _ in range(_WALK):
        nxt = []
        for value in frontier:
            for use in value.uses():
                node = use.node
                if id(node) in seen:
                    continue
                seen.add(id(node))
                if _standard(node, "Attention") and use.idx in (1, 2):
                    return node, 3
                if _standard(node, "Concat") and node.attributes.get_int("axis", 0) in (2, -2):
                    return None  # more keys after the buffer (a merged cross-attention's)
                if _standard(node, "Softmax"):
                    add = node.inputs[0].producer()
                    if _standard(add, "Add"):
                        side = 1 if _reaches(present, add.inputs[0]) else 0
                        return add, side
                    if add is not None and add.op_type in _SCORE_OPS and add.domain == "":
                        return node, -1
                    return None  # e.g. a sink Concat'ed to the scores: the keys are not last
                nxt.extend(node.outputs)
        frontier = nxt
    return None


def _reaches(source: ir.Value, value: ir.Value, depth: int = _WALK + 2) -> bool:
    """Whether ``value`` is computed from ``source`` within ``depth`` producers."""
    frontier = [value]
    for _ in range(depth):
        nxt = []
        for v in frontier:
            if v is source:
                return True
            node = v.producer()
            if node is not None:
                nxt.extend(i for i in node.inputs if i is not None)
        frontier = nxt
    return False


def _sequence_dim(present: ir.Value) -> str | None:
    """The name of ``present``'s symbolic sequence axis (the copying cache's total length)."""
    if present.shape is None or len(present.shape) < 3:
        return None
    dim = present.shape[2]
    return str(dim.value) if isinstance(dim, ir.SymbolicDim) and dim.value else None


def _forget_total_lengths(buffers: list[ir.Value], totals: set[str]) -> None:
    """Drop the shapes of the values computed from ``buffers`` that name a copying cache's
    total length (``totals``): those axes are the buffers' capacity now. Shape inference run
    before this pass (the checks after each pass run it) annotated, say, the keys' transpose
    ``(batch, H, d, total_sequence)``; ONNX Runtime's allocator then took the scores over all
    C buffer positions for the size of T5's position bias over the L valid keys (also
    ``total_sequence``), and failed ("Shape mismatch attempting to re-use buffer
    {2,4,3,3} != {2,4,3,5}"). ONNX Runtime infers them again from the buffers' shapes."""
    if not totals:
        return
    seen: set[int] = set()
    frontier = [
        node for value in buffers for node in {id(u.node): u.node for u in value.uses()}.values()
    ]
    while frontier:
        node = frontier.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for out in node.outputs:
            if out.is_graph_output() or out.shape is None:
                pass
            elif any(isinstance(d, ir.SymbolicDim) and str(d.value) in totals for d in out.shape):
                out.shape = None
            frontier.extend(use.node for use in out.uses())


class StaticKVCachePass(ir.passes.InPlacePass):
    def requires(self, model: ir.Model) -> None:
        require_lowered_attention(model, self, "the static KV cache", "LowerAttentionPass")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = set(contract.names_with_role(model, contract.PAST_KEY, contract.PAST_VALUE))
        pasts = [v for v in graph.inputs if v.name in names]
        if not pasts or contract.names_with_role(model, contract.PAST_LENGTH):
            return ir.passes.PassResult(model, modified=False)
        if contract.names_with_role(model, contract.PAST_TOKENS):
            logger.info("KV cache stays copying: cached token values (an indexer's keys) grow too")
            return ir.passes.PassResult(model, modified=False)
        removed = common.RemoveUnusedNodesPass()(model).modified  # even if the cache stays copying
        concats = []
        for past in pasts:
            for use in past.uses():
                if _is_shape(use.node):
                    continue
                if _is_cache_concat(use.node, use.idx):
                    concats.append(use.node)
                else:
                    logger.info("KV cache stays copying: %s is read by %s", past.name, use.node)
                    return ir.passes.PassResult(model, modified=removed)
        keys = set(contract.names_with_role(model, contract.PAST_KEY))
        slots = {}
        for concat in concats:
            if concat.inputs[0].name not in keys:  # values: the keys' scores carry the mask
                continue
            slot = _attention_bias_slot(concat.outputs[0])
            if slot is None:
                logger.info("KV cache stays copying: no attention found over %s", concat.name)
                return ir.passes.PassResult(model, modified=removed)
            slots.setdefault(id(slot[0]), (slot, concat))
        length = ir.Value(
            name=contract.PAST_LENGTH_NAME,
            type=ir.TensorType(ir.DataType.INT64),
            shape=ir.Shape([1]),
        )
        graph.inputs.append(length)
        contract.set_role(model, contract.PAST_LENGTH_NAME, contract.PAST_LENGTH)
        for past in pasts:  # its shape, with the past length on the sequence axis
            stale = _shape_reads(past)
            tape = ir.tape.Tape()
            vector = _shape_with_length(tape, past, length)
            _reroute_shapes(tape, past, stale, vector)
            insert_tape(graph, graph.node(0), tape)
            for node in stale:
                graph.remove(node, safe=True)
        scattered = {}
        totals = {_sequence_dim(c.outputs[0]) for c in concats} - {None}
        for concat in concats:
            scattered[id(concat)] = self._scatter(graph, concat, length)
        for (node, slot), concat in slots.values():
            present, new = scattered[id(concat)]
            self._pad_bias(graph, node, slot, present, new, length)
        _forget_total_lengths([present for present, _new in scattered.values()], totals)
        for past in pasts:
            past.shape = ir.Shape([*past.shape[:2], contract.BUFFER_DIM, *past.shape[3:]])
        version = model.opset_imports.get("", 0)
        model.opset_imports[""] = max(version, SCATTER_OPSET)
        model.metadata_props[contract.KV_LAYOUT_KEY] = "static"
        expose_row_lengths(model)
        logger.info("KV cache: %d static buffers written in place (TensorScatter)", len(pasts))
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _scatter(graph: ir.Graph, concat: ir.Node, length: ir.Value):
        """``Concat(past, new)`` → ``TensorScatter``; (its output, ``new``)."""
        past, new = concat.inputs
        present = concat.outputs[0]
        base = _base(concat)
        tape = ir.tape.Tape()
        batch = tape.op("Shape", [past], {"start": 0, "end": 1}, name=f"{base}_batch")
        rows = row_lengths_value(graph)  # each row written at its own past length
        if rows is None:
            rows = tape.op("Expand", [length, batch], name=f"{base}_write_at")
        written = tape.op("TensorScatter", [past, new, rows], {"axis": -2}, name=f"{base}_scatter")
        written.type = present.type
        written.shape = ir.Shape([*past.shape[:2], contract.BUFFER_DIM, *past.shape[3:]])
        # the present's shape as before: its sequence axis the total, past length + new tokens
        new_len = tape.op("Shape", [new], {"start": 2, "end": 3})
        total = tape.op("Add", [length, new_len], name=f"{base}_total")
        stale = _shape_reads(present)
        _reroute_shapes(tape, present, stale, _shape_with_length(tape, new, total))
        insert_tape(graph, concat, tape)
        for node in stale:
            graph.remove(node, safe=True)
        replace_value(present, written)
        graph.remove(concat, safe=True)
        return written, new

    @staticmethod
    def _pad_bias(graph, node: ir.Node, slot: int, present, new, length) -> None:
        """Give the attention's bias (or mask) the buffer's key length, −inf beyond it."""
        base = _base(node)
        tape = ir.tape.Tape()
        capacity = tape.op("Shape", [present], {"start": 2, "end": 3}, name=f"{base}_cap")
        bias = node.inputs[slot] if 0 <= slot < len(node.inputs) else None
        if bias is not None and (bias.shape is None or bias.shape[-1] != 1):
            key_len = tape.op("Shape", [bias], {"start": -1})
            grow = tape.op("Sub", [capacity, key_len])
            zero = tape.initializer(ir.tensor(np.array([0], np.int64)), name=f"{base}_p0")
            pads = tape.op("Concat", [zero, grow], {"axis": 0})  # (begin, end) of the key axis
            last = tape.initializer(ir.tensor(np.array([-1], np.int64)), name=f"{base}_pax")
            dtype = bias.dtype or ir.DataType.FLOAT
            fill = False if dtype == ir.DataType.BOOL else -np.inf
            value = tape.initializer(
                ir.tensor(np.array(fill, dtype=dtype.numpy())), name=f"{base}_pad_value"
            )
            padded = tape.op("Pad", [bias, pads, value, last], name=f"{base}_bias_to_buffer")
            padded.type = bias.type
            insert_tape(graph, node, tape)
            node.replace_input_with(slot, padded)
            return
        # no bias (or one broadcast over the keys): an additive mask of the valid positions
        new_len = tape.op("Shape", [new], {"start": 2, "end": 3})
        total = tape.op("Add", [length, new_len])
        zero = tape.initializer(ir.tensor(np.array(0, np.int64)), name=f"{base}_zero")
        one = tape.initializer(ir.tensor(np.array(1, np.int64)), name=f"{base}_one")
        squeeze = tape.initializer(ir.tensor(np.array([0], np.int64)), name=f"{base}_ax")
        positions = tape.op("Range", [zero, tape.op("Squeeze", [capacity, squeeze]), one])
        valid = tape.op("Less", [positions, total])
        dtype = (present.dtype or ir.DataType.FLOAT).numpy()
        ok = tape.initializer(ir.tensor(np.array(0, dtype)), name=f"{base}_ok")
        off = tape.initializer(ir.tensor(np.array(-np.inf, dtype)), name=f"{base}_off")
        mask = tape.op("Where", [valid, ok, off], name=f"{base}_valid_keys")
        if slot == -1:  # scores → Softmax: add the mask in between
            scores = node.inputs[0]
            added = tape.op("Add", [scores, mask], name=f"{base}_masked")
            added.type, added.shape = scores.type, scores.shape
            insert_tape(graph, node, tape)
            node.replace_input_with(0, added)
        elif bias is not None:  # a bias broadcast over the keys: add the mask to it
            combined = tape.op("Add", [bias, mask])
            insert_tape(graph, node, tape)
            node.replace_input_with(slot, combined)
        else:  # Attention without a mask: the mask as its (T, C) attn_mask
            queries = tape.op("Shape", [node.inputs[0]], {"start": -2, "end": -1})
            ones = tape.initializer(ir.tensor(np.array([1], np.int64)), name=f"{base}_ones")
            rows = tape.op("Concat", [queries, ones], {"axis": 0})  # (T, 1)
            mask = tape.op("Expand", [tape.op("Unsqueeze", [mask, squeeze]), rows])
            insert_tape(graph, node, tape)
            while len(node.inputs) < 4:
                node.resize_inputs(len(node.inputs) + 1)
            node.replace_input_with(3, mask)
