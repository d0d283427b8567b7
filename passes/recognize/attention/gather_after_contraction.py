"""Contract a relative-position table with the queries first, then gather its rows.

Relative-key attention (Shaw et al.; Hugging Face's ``relative_key`` BERTs) gathers one table
row per (query, key) pair and contracts the result with the queries:

    rel = Gather(table, idx)               # (U, V, F): one row of R per pair
    y   = Einsum("bhud,uvhd->bhuv", q, Reshape(rel, (U, V, H, D)))

That materializes U·V·F values and contracts all of them: O(U·V·F) per call, a decode step
growing with the past by the width of the model. The table has only R rows (2k + 1 clipped
distances), so contracting the table first and gathering scalars costs O(U·R·F + H·U·V):

    e = Einsum("bhud,rhd->bhur", q, Reshape(table, (R, H, D)))       # (B, H, U, R)
    y = Gather(Reshape(e, (B, H, U·R)), Mod(idx, R) + Range(U)·R, axis=2)

1. For any ``y = Einsum(eq, a, g)`` (either operand order) where ``g`` is
   ``[Reshape(]Gather(C, idx)[)]`` or ``GatherND(C, idx[..., None])`` (``batch_dims`` 0) of a
   constant ``C`` of shape (R, F) with R ≤ :data:`MAX_ROWS`, ``idx`` of rank 2 (labels u, v in
   ``g``), the Reshape (if any) only splitting F, ``u`` a label of ``a`` and ``v`` not, and
   ``y``'s last two labels ``u v``: rewrite as above. ``Mod`` keeps the Gather's negative
   indices (which count from the end) exact.

Everything else is left as it is. The value is the same sums in another order (fp32 noise).
A decode step's cost then grows with the past by H values per key, as the kernel's own does.
"""

from __future__ import annotations

import logging
import string

import numpy as np
import onnx_ir as ir

from tfgraph.passes.provenance import layer_name
from tfgraph.passes.rewrite_utils import add_initializer, constant, insert_tape, replace_value

logger = logging.getLogger(__name__)

# tables with more rows than this stay gathered first: contracting all of them could cost more
# than the gather saves (a BERT relative_key table has 2·512 − 1 rows)
MAX_ROWS = 256
GATHERED_SUFFIX = "__gathered"  # names the rewritten value (reports, tests)


def _standard(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _parse(equation: str) -> tuple[list[str], str] | None:
    """(input labels, output labels) of an explicit two-operand equation without ellipsis."""
    equation = equation.replace(" ", "")
    if "->" not in equation or "." in equation:
        return None
    inputs, output = equation.split("->")
    operands = inputs.split(",")
    if len(operands) != 2 or not all(s.isalpha() for s in (*operands, output)):
        return None
    return operands, output


def _gathered_rows(value: ir.Value) -> tuple[np.ndarray, ir.Value, list[int]] | None:
    """(table, rank-2 index value, feature dims) when ``value`` is a table's rows gathered by
    a (U, V) index and optionally reshaped to (U, V, *features)."""
    node = value.producer()
    features = None
    if _standard(node, "Reshape"):
        shape = node.outputs[0].shape
        if shape is None or not all(isinstance(d, int) for d in list(shape)[2:]):
            return None
        features = [int(d) for d in list(shape)[2:]]
        node = node.inputs[0].producer()
    if _standard(node, "Gather") and node.attributes.get_int("axis", 0) == 0:
        table, index = constant(node.inputs[0]), node.inputs[1]
        if index.shape is None or len(index.shape) != 2:
            return None
    elif _standard(node, "GatherND") and node.attributes.get_int("batch_dims", 0) == 0:
        table, index = constant(node.inputs[0]), node.inputs[1]
        if index.shape is None or len(index.shape) != 3 or index.shape[2] != 1:
            return None
    else:
        return None
    if table is None or table.ndim != 2 or table.shape[0] > MAX_ROWS:
        return None
    features = features if features is not None else [table.shape[1]]
    if int(np.prod(features)) != table.shape[1]:
        return None
    return table, index, features


def _matches(node: ir.Node):
    """What the rewrite needs from ``node``, or None when it is not the case above."""
    if not _standard(node, "Einsum") or len(node.inputs) != 2:
        return None
    parsed = _parse(node.attributes.get_string("equation", ""))
    if parsed is None:
        return None
    labels, output = parsed
    for g in (0, 1):
        found = _gathered_rows(node.inputs[g])
        if found is None:
            continue
        table, index, features = found
        a_labels, g_labels = labels[1 - g], labels[g]
        if len(g_labels) != 2 + len(features):
            continue
        u, v = g_labels[:2]
        if u in a_labels and v not in a_labels and output.endswith(u + v):
            return g, table, index, features, a_labels, g_labels, output
    return None


class GatherAfterContractionPass(ir.passes.InPlacePass):
    """Rewrites relative-key Einsums over gathered table rows (case 1 of the module doc)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        count = 0
        flat_indices: dict[tuple[int, int], ir.Value] = {}
        for node in list(model.graph):
            found = _matches(node)
            if found is None:
                continue
            self._rewrite(model.graph, node, found, flat_indices)
            logger.info("%s: relative-key table contracted before its gather", layer_name(node))
            count += 1
        return ir.passes.PassResult(model, modified=count > 0)

    def _rewrite(self, graph: ir.Graph, node: ir.Node, found, flat_indices) -> None:
        g, table, index, features, a_labels, g_labels, output = found
        rows = table.shape[0]
        r = next(c for c in string.ascii_letters if c not in a_labels + g_labels + output)
        u, v = g_labels[:2]
        tape = ir.tape.Tape()

        def const(array: np.ndarray) -> ir.Value:
            return tape.op("Constant", [], attributes={"value": ir.tensor(array)})

        table_value = add_initializer(graph, "relative_table", table.reshape(rows, *features))
        operands = [node.inputs[1 - g], table_value]
        equation = f"{a_labels},{r}{g_labels[2:]}->{output[:-1]}{r}"
        contracted = tape.op("Einsum", operands, attributes={"equation": equation})
        merged = tape.op(
            "Reshape", [contracted, const(np.array([0] * (len(output) - 2) + [-1], np.int64))]
        )
        key = (id(index), rows)
        if key not in flat_indices:
            flat_indices[key] = self._flat_index(tape, const, index, rows)
        gathered = tape.op(
            "Gather", [merged, flat_indices[key]], attributes={"axis": len(output) - 2}
        )
        insert_tape(graph, node, tape)
        gathered.shape, gathered.type = node.outputs[0].shape, node.outputs[0].type
        gathered.name = f"{node.outputs[0].name}{GATHERED_SUFFIX}"
        replace_value(node.outputs[0], gathered)
        graph.remove(node, safe=True)

    @staticmethod
    def _flat_index(tape: ir.tape.Tape, const, index: ir.Value, rows: int) -> ir.Value:
        """``Mod(idx, R) + Range(U)·R`` as int64: row u's entries index the u-th block of R."""
        if len(index.shape) == 3:  # GatherND's (U, V, 1)
            index = tape.op("Squeeze", [index, const(np.array([2], np.int64))])
        index = tape.op("Cast", [index], attributes={"to": ir.DataType.INT64})
        index = tape.op("Mod", [index, const(np.array(rows, np.int64))])
        first = tape.op("Shape", [index], attributes={"start": 0, "end": 1})
        stop = tape.op("Mul", [tape.op("Squeeze", [first]), const(np.array(rows, np.int64))])
        step = const(np.array(rows, np.int64))
        starts = tape.op("Range", [const(np.array(0, np.int64)), stop, step])
        starts = tape.op("Unsqueeze", [starts, const(np.array([1], np.int64))])
        return tape.op("Add", [index, starts])
