"""Compute only the new tokens' rows of cached machinery: a slice pushed toward its sources.

:mod:`.insert_kv_cache` recomputes machinery (positions, masks, position biases) at the total
length L = past + T and hands token ops its last T rows along the query axes. Slicing the
finished value costs what the whole value costs: a T5 relative bias or an ALiBi bias is
(H, L, L) per step, O(H·L²) for one new token. Pushed through the ops that computed it, the
slice lands on the 1-D position ranges they started from, and every op downstream works on
(…, T, L): O(H·T·L) per step, flat per token in the past length up to the O(L) key axis.

:func:`last_rows` rebuilds ``value`` with ``axes`` cut to their last T entries (start = past
length), node by node, for the ops where the cut commutes with the op:

- elementwise and comparison ops (with broadcasting: an input whose axis is 1 is not cut),
- ``Transpose``, ``Unsqueeze``, ``Squeeze``, ``Cast`` and the unary ops (axes mapped),
- ``Gather`` (the cut goes to the indices or to the data, whichever holds the axis),
- ``Expand`` (the target shape shrinks by the past length on the axis),
- ``Range`` (``Range(s, l, d)[p:] = Range(s + p·d, l, d)``),
- ``Trilu`` cut along its rows only (``tril(x, k)[p:] = tril(x[p:], k + p)``).

Anywhere else (an unknown dim, a ``Reshape``, a ``Concat`` along the cut axis, control flow)
it falls back to a ``Slice`` of the value recomputed at L: never wrong, only slower. The cut
values get the same shapes as the ``Slice`` would have: the cut axes T, the other token
lengths L.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tfgraph.passes.rewrite_utils import dims_of, int_list

UNARY = {
    "Cast",
    "Cos",
    "Sin",
    "Neg",
    "Abs",
    "Exp",
    "Log",
    "Sqrt",
    "Reciprocal",
    "Relu",
    "Tanh",
    "Sigmoid",
    "Softplus",
    "Identity",
    "Not",
    "Floor",
    "Ceil",
    "Sign",
    "IsInf",
    "IsNaN",
}
BROADCASTING = {
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Max",
    "Min",
    "Mod",
    "Where",
    "Equal",
    "Less",
    "LessOrEqual",
    "Greater",
    "GreaterOrEqual",
    "And",
    "Or",
    "Xor",
    "BitwiseAnd",
    "BitwiseOr",
}
# data inputs of a few ops that take extra, non-sliced operands (Clip's bounds)
DATA_INPUTS = {"Clip": 1}
INT64_MAX = np.iinfo(np.int64).max


class Slicer:
    """Cuts machinery values to the new tokens' rows on top of a KV-cache rewriter (which
    provides ``full``, ``add``, ``const``, ``past_len``, ``a.seq``, ``a.machinery`` and the
    ``pending`` node list, see :class:`.kv_rewrite.Rewriter`)."""

    def __init__(self, rewriter, total_dim: str) -> None:
        self.rw, self.total = rewriter, total_dim
        self.memo: dict[tuple[ir.Value, tuple[int, ...]], ir.Value] = {}
        self.pushed = 0  # nodes rebuilt on cut inputs (for the log and the tests)

    # --- the entry point ------------------------------------------------------------------

    def last_rows(self, value: ir.Value, axes: list[int]) -> ir.Value:
        axes = sorted(set(axes))
        if not axes:
            return self.rw.full(value)
        key = (value, tuple(axes))
        if key not in self.memo:
            out = self._pushed(value, axes)
            if out is None:
                out = self._slice(value, axes)
            self.memo[key] = out
        return self.memo[key]

    # --- helpers ----------------------------------------------------------------------------

    def _shape_after_cut(self, value: ir.Value, axes: list[int]) -> ir.Shape:
        seq = self.rw.a.seq
        return ir.Shape(
            [
                seq if i in axes else (self.total if d == seq else d)
                for i, d in enumerate(dims_of(value))
            ]
        )

    def _slice(self, value: ir.Value, axes: list[int]) -> ir.Value:
        rw = self.rw
        full = rw.full(value)
        starts = (
            rw.past_len
            if len(axes) == 1
            else rw.add("Concat", [rw.past_len] * len(axes), {"axis": 0})
        )
        ends = rw.const(np.full(len(axes), INT64_MAX, np.int64))
        out = rw.add("Slice", [full, starts, ends, rw.const(np.array(axes, np.int64))])
        out.type, out.shape = value.type, self._shape_after_cut(value, axes)
        return out

    def _input(self, value: ir.Value | None, axes: list[int]) -> ir.Value | None:
        """An operand: cut along ``axes`` if it is machinery, else as it is."""
        if value is None or value not in self.rw.a.machinery:
            return value
        return self.last_rows(value, axes) if axes else self.rw.full(value)

    def _rebuild(self, node: ir.Node, value: ir.Value, axes: list[int], inputs: list) -> ir.Value:
        attributes = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
        clone = ir.Node(
            node.domain,
            node.op_type,
            inputs,
            attributes=attributes,
            num_outputs=len(node.outputs),
            version=node.version,
            name=f"{node.name}__new_rows" if node.name else None,
            metadata_props=dict(node.metadata_props),
        )
        self.rw.pending.append(clone)
        self.pushed += 1
        out = clone.outputs[list(node.outputs).index(value)]
        out.type, out.shape = value.type, self._shape_after_cut(value, axes)
        if value.name:
            out.name = f"{value.name}__new_rows"
        return out

    def _cut_axes(self, operand: ir.Value, out_rank: int, axes: list[int]) -> list[int] | None:
        """The operand's axes to cut for a broadcasting op, or None when one is neither the
        sequence nor 1 (an unknown dim: the cut cannot be told to apply)."""
        if operand.shape is None:
            return None
        dims = dims_of(operand)
        shift = out_rank - len(dims)
        cut = []
        for a in axes:
            if a - shift < 0:
                continue
            d = dims[a - shift]
            if d == 1:
                continue
            if d != self.rw.a.seq:
                return None
            cut.append(a - shift)
        return cut

    # --- the ops the cut goes through --------------------------------------------------------

    def _pushed(self, value: ir.Value, axes: list[int]) -> ir.Value | None:
        node = value.producer()
        if node is None or value.shape is None or node.domain not in ("", "ai.onnx"):
            return None
        if any(
            a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
            for a in node.attributes.values()
        ):
            return None
        op, rank = node.op_type, len(value.shape)
        if op in UNARY or op in DATA_INPUTS:
            data = node.inputs[0]
            if data is None or data.shape is None or len(data.shape) != rank:
                return None
            rest = [self._input(v, []) for v in node.inputs[1:]]
            return self._rebuild(node, value, axes, [self._input(data, axes), *rest])
        if op in BROADCASTING:
            inputs = []
            for operand in node.inputs:
                if operand is None:
                    inputs.append(None)
                    continue
                cut = self._cut_axes(operand, rank, axes)
                if cut is None:
                    return None
                inputs.append(self._input(operand, cut))
            return self._rebuild(node, value, axes, inputs)
        if op == "Transpose":
            perm = node.attributes.get_ints("perm", list(reversed(range(rank))))
            return self._rebuild(
                node, value, axes, [self._input(node.inputs[0], [perm[a] for a in axes])]
            )
        if op in ("Unsqueeze", "Squeeze"):
            return self._squeezes(node, value, axes)
        if op == "Gather":
            return self._gather(node, value, axes)
        if op == "MatMul":
            return self._matmul(node, value, axes)
        if op == "Concat":
            return self._concat(node, value, axes)
        if op == "GatherND":
            return self._gather_nd(node, value, axes)
        if op == "Reshape":
            return self._reshape(node, value, axes)
        if op == "Expand":
            return self._expand(node, value, axes)
        if op == "Range":
            return self._range(node, value, axes)
        if op == "Trilu":
            return self._trilu(node, value, axes)
        return None

    def _squeezes(self, node: ir.Node, value: ir.Value, axes: list[int]) -> ir.Value | None:
        data = node.inputs[0]
        listed = int_list(node.inputs[1]) if len(node.inputs) > 1 else None
        if data is None or data.shape is None or listed is None:
            return None
        if node.op_type == "Unsqueeze":
            rank = len(value.shape)
            added = sorted(a % rank for a in listed)
            kept = [a for a in range(rank) if a not in added]  # output axis of input axis i
        else:
            in_rank = len(data.shape)
            removed = {a % in_rank for a in listed}
            kept = [a for a in range(in_rank) if a not in removed]
            # output axis j is input axis kept[j]
            return self._rebuild(
                node, value, axes, [self._input(data, [kept[a] for a in axes]), node.inputs[1]]
            )
        if any(a not in kept for a in axes):
            return None
        return self._rebuild(
            node, value, axes, [self._input(data, [kept.index(a) for a in axes]), node.inputs[1]]
        )

    def _gather(self, node: ir.Node, value: ir.Value, axes: list[int]) -> ir.Value | None:
        data, indices = node.inputs[0], node.inputs[1]
        if data is None or indices is None or data.shape is None or indices.shape is None:
            return None
        g = node.attributes.get_int("axis", 0) % len(data.shape)
        r = len(indices.shape)
        data_axes, index_axes = [], []
        for a in axes:
            if a < g:
                data_axes.append(a)
            elif a < g + r:
                index_axes.append(a - g)
            else:
                data_axes.append(a - r + 1)
        return self._rebuild(
            node, value, axes, [self._input(data, data_axes), self._input(indices, index_axes)]
        )

    def _matmul(self, node: ir.Node, value: ir.Value, axes: list[int]) -> ir.Value | None:
        """Rows of the product come from A's rows, columns from B's columns, batch axes from
        both (broadcasting)."""
        a, b = node.inputs[0], node.inputs[1]
        rank = len(value.shape)
        if a is None or b is None or a.shape is None or b.shape is None:
            return None
        if len(a.shape) < 2 or len(b.shape) < 2:
            return None
        batch = [x for x in axes if x < rank - 2]
        cuts = []
        for operand, own in ((a, rank - 2), (b, rank - 1)):
            operand_rank = len(operand.shape)
            # batch axes: broadcast over the leading dims (the last two are the matrix)
            shifted = [x - (rank - operand_rank) for x in batch]
            cut = []
            for x in shifted:
                if x < 0:
                    continue
                d = dims_of(operand)[x]
                if d == 1:
                    continue
                if d != self.rw.a.seq:
                    return None
                cut.append(x)
            if own in axes:
                local = operand_rank - 2 if own == rank - 2 else operand_rank - 1
                if dims_of(operand)[local] != self.rw.a.seq:
                    return None
                cut.append(local)
            cuts.append(cut)
        return self._rebuild(node, value, axes, [self._input(a, cuts[0]), self._input(b, cuts[1])])

    def _concat(self, node: ir.Node, value: ir.Value, axes: list[int]) -> ir.Value | None:
        rank = len(value.shape)
        if node.attributes.get_int("axis", 0) % rank in axes:
            return None
        inputs = []
        for operand in node.inputs:
            if operand is None or operand.shape is None:
                return None
            if any(dims_of(operand)[x] != self.rw.a.seq for x in axes):
                return None
            inputs.append(self._input(operand, axes))
        return self._rebuild(node, value, axes, inputs)

    def _gather_nd(self, node: ir.Node, value: ir.Value, axes: list[int]) -> ir.Value | None:
        data, indices = node.inputs[0], node.inputs[1]
        if (
            node.attributes.get_int("batch_dims", 0) != 0
            or indices is None
            or indices.shape is None
        ):
            return None
        outer = len(indices.shape) - 1  # output axes taken from the indices
        if any(a >= outer for a in axes):
            return None
        return self._rebuild(node, value, axes, [self._input(data, []), self._input(indices, axes)])

    def _reshape(self, node: ir.Node, value: ir.Value, axes: list[int]) -> ir.Value | None:
        """A reshape that keeps every axis up to the last cut one (it splits or merges only
        later axes): the data is cut, and the target's cut entries lose the past length."""
        data, shape = node.inputs[0], node.inputs[1]
        rank = len(value.shape)
        if data is None or data.shape is None or shape is None or shape.shape is None:
            return None
        if list(dims_of(shape)) != [rank]:
            return None
        upto = max(axes) + 1
        if len(data.shape) < upto or dims_of(data)[:upto] != dims_of(value)[:upto]:
            return None
        if any(d is None for d in dims_of(value)[:upto]):
            return None
        rw = self.rw
        of_cut = self._shape_of_cut(shape, rank, axes)
        if of_cut is not None:
            return self._rebuild(node, value, axes, [self._input(data, axes), of_cut])
        target = self._target(shape)
        shrunk = self._minus_past(target, [int(a in axes) for a in range(rank)])
        # 0 (copy the input's dim) and -1 (inferred) stay as they are
        special = rw.add("LessOrEqual", [target, rw.const(np.array(0, np.int64))])
        target = rw.add("Where", [special, target, shrunk])
        return self._rebuild(node, value, axes, [self._input(data, axes), target])

    def _expand(self, node: ir.Node, value: ir.Value, axes: list[int]) -> ir.Value | None:
        data, shape = node.inputs[0], node.inputs[1]
        rank = len(value.shape)
        if data is None or data.shape is None or shape is None or shape.shape is None:
            return None
        if list(dims_of(shape)) != [rank]:
            return None  # a shape argument shorter than the output: not handled
        cut = self._cut_axes(data, rank, axes)
        if cut is None:
            return None
        rw = self.rw
        of_cut = self._shape_of_cut(shape, rank, axes)
        if of_cut is not None:  # the data broadcasts to, or already has, the cut length
            return self._rebuild(node, value, axes, [self._input(data, cut), of_cut])
        shift = rank - len(data.shape)
        # the target's cut entries: 1 where the data is cut itself (broadcasting keeps its
        # length), L - past = T where the data broadcasts along the axis
        sliced_data = {a + shift for a in cut}
        minus = np.array([int(a in axes and a not in sliced_data) for a in range(rank)], np.int64)
        ones = np.array([int(a in sliced_data) for a in range(rank)], np.int64)
        target = self._target(shape)
        if minus.any():
            target = self._minus_past(target, minus)
        if ones.any():
            keep = rw.const((1 - ones).astype(np.int64))
            target = rw.add("Add", [rw.add("Mul", [target, keep]), rw.const(ones)])
        return self._rebuild(node, value, axes, [self._input(data, cut), target])

    def _target(self, shape: ir.Value) -> ir.Value:
        """An Expand/Reshape target at the total length (machinery is used at full size)."""
        return self.rw.full(shape) if shape in self.rw.a.machinery else shape

    def _minus_past(self, target: ir.Value, mask) -> ir.Value:
        """``target`` with the past length taken off the entries ``mask`` marks."""
        rw = self.rw
        minus = rw.const(np.asarray(mask, np.int64))
        return rw.add("Sub", [target, rw.add("Mul", [minus, rw.past_len])])

    def _shape_of_cut(self, shape: ir.Value, rank: int, axes: list[int]) -> ir.Value | None:
        """``Shape(x)`` of machinery ``x`` as an Expand/Reshape target: ``Shape`` of ``x`` cut
        along the same axes, so the full ``x`` is never computed just for its shape (HF T5's
        ``zeros_like`` of the (L, L) relative positions)."""
        node = shape.producer()
        if node is None or node.op_type != "Shape" or node.domain not in ("", "ai.onnx"):
            return None
        if node.attributes.get_int("start", 0) != 0 or "end" in node.attributes:
            return None
        source = node.inputs[0]
        if source not in self.rw.a.machinery or source.shape is None:
            return None
        if len(source.shape) != rank or self._cut_axes(source, rank, axes) != axes:
            return None
        return self.rw.add("Shape", [self.last_rows(source, axes)])

    def _range(self, node: ir.Node, value: ir.Value, axes: list[int]) -> ir.Value | None:
        if axes != [0]:
            return None
        rw = self.rw
        start, limit, delta = (rw.full(v) if v in rw.a.machinery else v for v in node.inputs)
        # Range's operands are scalars; the past length is a 1-element vector
        past = rw.add("Squeeze", [rw.add("Cast", [rw.past_len], {"to": value.type.dtype.value})])
        start = rw.add("Add", [start, rw.add("Mul", [past, delta])])
        return self._rebuild(node, value, axes, [start, limit, delta])

    def _trilu(self, node: ir.Node, value: ir.Value, axes: list[int]) -> ir.Value | None:
        rank = len(value.shape)
        if axes != [rank - 2]:
            return None
        rw = self.rw
        k = node.inputs[1] if len(node.inputs) > 1 else None
        past = rw.add("Squeeze", [rw.past_len])
        k = past if k is None else rw.add("Add", [rw.full(k) if k in rw.a.machinery else k, past])
        return self._rebuild(node, value, axes, [self._input(node.inputs[0], axes), k])
