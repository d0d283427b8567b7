"""Per-row past lengths in a cached graph: the rows of one batch at different lengths.

In-flight batching (:mod:`tfgraph.runtime.inflight`) keeps requests in the rows ("slots") of
one preallocated KV buffer; each row has its own past length P_b, and its new tokens sit at
positions P_b … P_b + T − 1. :class:`~.insert_kv_cache.InsertKVCachePass` with
``row_lengths=True`` builds the graph for that:

- a value ``past_sequence_lengths`` (batch,) int64, every row's past length: here the common
  past length broadcast to the batch (so the graph is unchanged in meaning for equal rows);
  :class:`~.share_kv_buffer.ShareKVBufferPass` turns it into a graph input (role
  ``past_lengths``), and the attention kernel reads its per-row sequence lengths from it
  (GroupQueryAttention's ``seqlens_k``);
- at each junction, where token ops read machinery (positions, position rows, biases), the
  machinery computed at the total length L is **gathered per row** at P_b + t instead of
  sliced to its last T rows (:meth:`RowGather.rows`): a (L, d) table of position rows becomes
  (B, T, d), a (1, H, L, L) relative bias (B, H, T, L), a (B, L) mask-derived position
  (B, T). Keys beyond a row's length are never read (the kernel stops at ``seqlens_k``).

The gather reads the machinery at L; the pushed slice of :mod:`.slice_machinery` (which only
computes the new rows) cannot follow a start that differs per row. So a row-length graph
computes each gathered junction's machinery for all L rows per step: O(L·d) for position rows
or an unfolded RoPE table (a folded one disappears into the kernel: FoldRotaryPass reads the
table through the gather, :func:`rows_read`).

A junction this does not gather keeps the slice, and the graph does not take per-row
lengths: the reason is recorded (``tfgraph.row_lengths`` metadata) and the input is not
exposed. Not gathered: an op other than a broadcasting elementwise one or the attention bias,
two query axes, a leading axis that is neither 1 nor the batch, and a position bias over
queries × keys that is not a function of i − j (Shaw's keys, read by a MatMul; an ``additive``
bias): a per-row gather along its query axis would need the whole (L, L) square, O(H·L²) (a
tiny T5's step: 0.6 ms at past 128, 46 ms at 1016).

A bias over queries × keys that :mod:`.classify_attention_bias` measured to be a function of
i − j (``bias_kind`` ``alibi`` or ``relative``: ALiBi, T5's buckets, each up to a constant per
query row, which the softmax ignores) keeps its pushed slice, O(H·T·L) per step, computed at
the common past length F (the longest row's): rows F … F + T − 1, keys 0 … L − 1. Row b needs
rows P_b + t and keys j; since bias(P_b + t, j) = bias(F + t, j + F − P_b), it reads the slice
**shifted along the keys** by F − P_b (:meth:`RowGather.shifted`, a GatherElements; a key
index past L − 1 is clamped, and those keys lie beyond the row's length, masked).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from tfgraph import contract
from tfgraph.passes.canonical import AttentionOp
from tfgraph.passes.recognize.attention.key_padding_bias import LEFT_PAD_SHIFT_KEY
from tfgraph.passes.rewrite_utils import dims_of

logger = logging.getLogger(__name__)

ROW_LENGTHS_KEY = contract.ROW_LENGTHS_KEY  # model metadata: "per_row" or why not
PER_ROW = "per_row"
# node metadata on the gathers this module adds: what they gather is the per-row rows of the
# value they read (FoldRotaryPass reads a RoPE table through them: the kernel rotates each
# row at its own positions)
ROW_GATHER_KEY = "tfgraph.row_gather"
# graph metadata of a per-row graph: the token input and a past input the per-row lengths
# are built from (a graph without position machinery has no reader of them until lowering,
# and the dead-node cleanup after the cache pass removes them: row_lengths_value rebuilds them)
ROW_LENGTHS_FROM_KEY = "tfgraph.row_lengths_from"

# token ops whose machinery operand broadcasts against the other (numpy rules)
BROADCASTING = {"Add", "Sub", "Mul", "Div", "Where", "Pow", "Max", "Min"}
BIAS_SLOT = AttentionOp.BIAS  # tfgraph.Attention(Q, K, V, bias)
# bias kinds measured to be a function of i − j (up to a constant per query row): a row at
# another past length reads them shifted along the keys
SHIFTABLE = ("alibi", "relative")


class RowGather:
    """Builds the per-row gathers of one cached graph on top of a KV-cache rewriter (its
    ``add``/``const``/``pending``)."""

    def __init__(self, rewriter, tokens: ir.Value, past_len: ir.Value) -> None:
        self.rw = rewriter
        self.tokens = tokens
        self.batch = dims_of(tokens)[0]
        self.refused: str | None = None
        self.memo: dict[tuple, ir.Value] = {}
        # (batch,) the common past length broadcast to every row (until the buffer pass makes
        # it an input)
        batch_dim = ir.node("Shape", [tokens], {"start": 0, "end": 1})
        expand = ir.node("Expand", [past_len, batch_dim.outputs[0]])
        expand.outputs[0].name = contract.PAST_LENGTHS_NAME
        expand.outputs[0].type = ir.TensorType(ir.DataType.INT64)
        expand.outputs[0].shape = ir.Shape([self.batch])
        self.nodes = [batch_dim, expand]
        self.lengths = expand.outputs[0]
        self._index: ir.Value | None = None
        self._padded: tuple[dict, dict] | None = None  # (rewriter memo, slicer memo)

    def refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason

    def index(self) -> ir.Value:
        """(B, T): row b's positions P_b … P_b + T − 1 (built once, before its first use)."""
        if self._index is None:
            rw = self.rw
            t = rw.add("Shape", [self.tokens], {"start": 1, "end": 2})
            steps = rw.add(
                "Range",
                [rw.const(np.array(0, np.int64)), rw.add("Squeeze", [t]),
                 rw.const(np.array(1, np.int64))],
            )  # fmt: skip
            self._index = rw.add(
                "Add",
                [
                    rw.add("Unsqueeze", [self.lengths, rw.const(np.array([1], np.int64))]),
                    rw.add("Unsqueeze", [steps, rw.const(np.array([0], np.int64))]),
                ],
            )
        return self._index

    def why_not(
        self, node: ir.Node, index: int, value: ir.Value, axes: list[int], seq
    ) -> str | None:
        """Why the junction ``node`` reading machinery ``value`` (query ``axes``) in input
        ``index`` cannot be gathered per row; None when it can. Checked for every junction
        before any is rewritten: a graph takes per-row lengths whole or not at all."""
        if node.op_type not in BROADCASTING and not _is_attention(node):
            return f"{node.op_type} reads positions ({value.name}) along the tokens"
        if len(axes) != 1:
            return f"'{value.name}' has {len(axes)} query axes"
        dims = list(dims_of(value))
        keys = len([d for d in dims if d in (seq, contract.TOTAL_DIM)]) > 1 or (
            _is_attention(node) and index == BIAS_SLOT and dims[-1] != 1
        )  # the attention bias's key axis is its last
        if keys:
            if self.shifts(node, index):
                lead = ([1] * (4 - len(dims)) + dims)[0]
                if len(dims) > 4 or lead not in (1, self.batch):
                    return f"the attention bias '{value.name}' is not (batch or 1, …, T, L)"
                return None
            kind = AttentionOp.read(node).bias_kind if _is_attention(node) else "not measured"
            if kind == "padding":
                kind += ", and it does not move with left padding"
            return (
                f"'{value.name}' is a position bias over queries x keys that is not a function "
                f"of i - j (bias_kind {kind}): gathered per row it would be computed whole, "
                "O(L^2) per step, where the sliced bias costs O(L); such models batch requests "
                "that arrive together"
            )
        rank = _rank(node)
        if rank is None or len(dims) > rank:
            return f"the rank of '{value.name}' against its consumer is unknown"
        axis = axes[0] + rank - len(dims)
        lead = ([1] * (rank - len(dims)) + dims)[0]
        if axis == 0:
            return f"'{value.name}' has its query axis first"
        if lead != 1 and lead != self.batch:
            return f"'{value.name}' has a leading axis {lead} (neither 1 nor the batch)"
        return None

    @staticmethod
    def shifts(node: ir.Node, index: int) -> bool:
        """Whether junction (``node``, ``index``) is an attention bias measured to be a
        function of i − j (or one that moves with left padding): each row reads the common
        slice shifted along the keys."""
        if not (_is_attention(node) and index == BIAS_SLOT):
            return False
        return AttentionOp.read(node).bias_kind in SHIFTABLE or RowGather.pads(node)

    @staticmethod
    def pads(node: ir.Node) -> bool:
        """A padding bias measured to move with left padding (:mod:`.key_padding_bias`): its
        common slice is computed on the mask with each row left-padded to the longest row."""
        return (
            AttentionOp.read(node).bias_kind == "padding"
            and node.metadata_props.get(LEFT_PAD_SHIFT_KEY) == "1"
        )

    def left_padded(self, rewriter, value: ir.Value, axes: list[int], seq) -> ir.Value:
        """``value``'s last rows (the common slice at F) computed on the attention masks with
        row b moved right by F − P_b (left-padded): a row at its own length, as the longest
        row sees it. Rebuilt on the rewriter with its masks replaced, memoized apart."""
        rw = self.rw
        if self._padded is None:
            masks = {}
            for mask in rw.a.masks:
                dims = dims_of(mask) if mask.shape is not None else []
                masks[mask] = self._shift_mask(mask, rw.past_len) if dims[-1:] == [seq] else mask
            self._padded = (masks, {})
        saved = rw.memo, rw.slicer.memo
        rw.memo, rw.slicer.memo = self._padded
        try:
            return rw.last_rows(value, axes)
        finally:
            rw.memo, rw.slicer.memo = saved

    def _shift_mask(self, mask: ir.Value, past_len: ir.Value) -> ir.Value:
        """(B, L) ``mask`` with row b moved right by F − P_b, zeros entering on the left."""
        rw = self.rw
        total = rw.add("Shape", [mask], {"start": 1, "end": 2})
        keys = rw.add(
            "Range",
            [rw.const(np.array(0, np.int64)), rw.add("Squeeze", [total]),
             rw.const(np.array(1, np.int64))],
        )  # fmt: skip
        shift = rw.add("Sub", [past_len, self.lengths])  # (B,)
        index = rw.add(
            "Sub",
            [
                rw.add("Unsqueeze", [keys, rw.const(np.array([0], np.int64))]),
                rw.add("Unsqueeze", [shift, rw.const(np.array([1], np.int64))]),
            ],
        )  # (B, L): j − (F − P_b)
        inside = rw.add("GreaterOrEqual", [index, rw.const(np.array(0, np.int64))])
        index = rw.add("Max", [index, rw.const(np.array(0, np.int64))])
        moved = rw.add("GatherElements", [mask, index], {"axis": 1})
        dtype = mask.dtype or ir.DataType.INT64
        out = rw.add("Mul", [moved, rw.add("Cast", [inside], {"to": dtype})])
        out.type, out.shape = mask.type, mask.shape
        return out

    def shifted(self, sliced: ir.Value, past_len: ir.Value) -> ir.Value:
        """The bias slice ``sliced`` (…, T, L), computed at the common past length
        ``past_len`` (F, shape [1]), per row: row b reads key j at j + F − P_b, clamped to
        L − 1 (beyond its own length, masked). (B, …, T, L)."""
        key = ("shifted", sliced)
        if key in self.memo:
            return self.memo[key]
        rw = self.rw
        dims = list(dims_of(sliced))
        rank = max(len(dims), 4)
        data = sliced
        if len(dims) < rank:
            lead = list(range(rank - len(dims)))
            data = rw.add("Unsqueeze", [data, rw.const(np.array(lead, np.int64))])
            dims = [1] * len(lead) + dims
        batch_dim = rw.add("Shape", [self.tokens], {"start": 0, "end": 1})
        ones = rw.const(np.ones(rank - 1, np.int64))
        data = rw.add("Expand", [data, rw.add("Concat", [batch_dim, ones], {"axis": 0})])
        total = rw.add("Shape", [sliced], {"start": -1})  # (1,) L
        keys = rw.add(
            "Range",
            [rw.const(np.array(0, np.int64)), rw.add("Squeeze", [total]),
             rw.const(np.array(1, np.int64))],
        )  # fmt: skip
        shift = rw.add("Sub", [past_len, self.lengths])  # (B,) F − P_b
        index = rw.add(
            "Add",
            [
                rw.add("Unsqueeze", [shift, rw.const(np.array([1], np.int64))]),
                rw.add("Unsqueeze", [keys, rw.const(np.array([0], np.int64))]),
            ],
        )  # (B, L)
        last = rw.add("Sub", [total, rw.const(np.array([1], np.int64))])
        index = rw.add("Min", [index, last])
        middle = rw.const(np.array(list(range(1, rank - 1)), np.int64))
        index = rw.add("Unsqueeze", [index, middle])  # (B, 1, …, 1, L)
        index = rw.add("Expand", [index, rw.add("Shape", [data])])
        result = rw.add("GatherElements", [data, index], {"axis": rank - 1})
        result.type = sliced.type
        result.shape = ir.Shape([self.batch, *dims[1:]])
        self.memo[key] = result
        return result

    def rows(
        self, node: ir.Node, full: ir.Value, value: ir.Value, axes: list[int], seq
    ) -> ir.Value | None:
        """``full`` (``value`` at L) gathered per row along its query axis, shaped to
        broadcast into ``node`` as ``value`` did (:meth:`why_not` said it can)."""
        rank = _rank(node)
        dims = list(dims_of(value))
        key = (full, axes[0], rank)
        if key in self.memo:
            return self.memo[key]
        rw = self.rw
        axis = axes[0] + rank - len(dims)
        if len(dims) < rank:  # leading broadcast axes, as numpy aligns them
            lead = list(range(rank - len(dims)))
            full = rw.add("Unsqueeze", [full, rw.const(np.array(lead, np.int64))])
            dims = [1] * len(lead) + dims
        index = self.index()
        if dims[0] == 1:  # shared by every row: gather the rows, the batch axis to the front
            squeezed = rw.add("Squeeze", [full, rw.const(np.array([0], np.int64))])
            gathered = rw.add("Gather", [squeezed, index], {"axis": axis - 1})
            perm = [axis - 1, *range(axis - 1), *range(axis, rank)]
            result = rw.add("Transpose", [gathered], {"perm": perm})
            for value in (squeezed, gathered, result):
                value.producer().metadata_props[ROW_GATHER_KEY] = "1"
        elif dims[0] == self.batch:  # a row of its own per batch row (from the mask)
            ones = [i for i in range(1, rank) if i != axis]  # (B, 1, …, T, …, 1)
            idx = index
            if ones:
                idx = rw.add("Unsqueeze", [index, rw.const(np.array(ones, np.int64))])
            target = rw.add(
                "Concat",
                [
                    rw.add("Shape", [full], {"start": 0, "end": axis}),
                    rw.add("Shape", [self.tokens], {"start": 1, "end": 2}),
                    *([rw.add("Shape", [full], {"start": axis + 1})] if axis + 1 < rank else []),
                ],
                {"axis": 0},
            )
            idx = rw.add("Expand", [idx, target])
            result = rw.add("GatherElements", [full, idx], {"axis": axis})
            result.producer().metadata_props[ROW_GATHER_KEY] = "1"
        else:  # why_not refused it
            raise AssertionError(f"'{value.name}': no per-row gather for this junction")
        result.type = value.type
        result.shape = ir.Shape(
            [self.batch if i == 0 else seq if i == axis else
             (contract.TOTAL_DIM if d == seq else d) for i, d in enumerate(dims)]
        )  # fmt: skip
        self.memo[key] = result
        return result


def row_lengths_value(graph: ir.Graph) -> ir.Value | None:
    """The (batch,) per-row past lengths the KV-cache pass made, if any; rebuilt (at the top
    of the graph) when the graph takes them but nothing read them before lowering: a model
    without position machinery (``nn.MultiheadAttention`` and no positions) has per-row
    lengths for its kernels' sake only."""
    for node in graph:
        if node.outputs and node.outputs[0].name == contract.PAST_LENGTHS_NAME:
            return node.outputs[0]
    names = graph.metadata_props.get(ROW_LENGTHS_FROM_KEY, "").split("\n")
    inputs = {v.name: v for v in graph.inputs}
    if len(names) != 2 or not all(name in inputs for name in names):
        return None
    tokens, past = (inputs[name] for name in names)
    batch = ir.node("Shape", [tokens], {"start": 0, "end": 1})
    length = ir.node("Shape", [past], {"start": 2, "end": 3})
    expand = ir.node("Expand", [length.outputs[0], batch.outputs[0]])
    value = expand.outputs[0]
    value.name, value.type = contract.PAST_LENGTHS_NAME, ir.TensorType(ir.DataType.INT64)
    value.shape = ir.Shape([dims_of(tokens)[0]])
    graph.insert_before(next(iter(graph)), [batch, length, expand])
    logger.debug("per-row past lengths rebuilt for the kernels (no machinery read them)")
    return value


def _rank(node: ir.Node) -> int | None:
    if _is_attention(node):
        return 4
    out = node.outputs[0]
    return len(out.shape) if out.shape is not None else None


def _is_attention(node: ir.Node) -> bool:
    return node.domain == "tfgraph" and node.op_type == "Attention"


def expose_row_lengths(model: ir.Model) -> None:
    """The per-row past lengths (:mod:`.row_lengths`) become the input
    ``past_sequence_lengths`` (role ``past_lengths``, (batch,) int64) when every junction took
    them; else they stay the common past length broadcast to the rows. Called by the buffer
    passes (:mod:`.share_kv_buffer`, :mod:`.static_kv_cache`) once the rows share a buffer."""
    graph = model.graph
    node = next(
        (n for n in graph if n.outputs and n.outputs[0].name == contract.PAST_LENGTHS_NAME),
        None,
    )
    if node is None or model.metadata_props.get(ROW_LENGTHS_KEY) != PER_ROW:
        return
    value = node.outputs[0]
    value.name = None
    lengths = ir.Value(
        name=contract.PAST_LENGTHS_NAME,
        type=ir.TensorType(ir.DataType.INT64),
        shape=ir.Shape([value.shape[0] if value.shape is not None else "batch"]),
    )
    graph.inputs.append(lengths)
    contract.set_role(model, contract.PAST_LENGTHS_NAME, contract.PAST_LENGTHS)
    value.replace_all_uses_with(lengths)
    graph.remove(node, safe=True)
    logger.info("KV cache: rows take their own past lengths (%s)", contract.PAST_LENGTHS_NAME)


def rows_read(value: ir.Value) -> ir.Value:
    """The value a per-row gather of this module reads (``value`` itself when it is none)."""
    node = value.producer()
    if node is None or node.metadata_props.get(ROW_GATHER_KEY) != "1":
        return value
    if node.op_type == "GatherElements":
        return node.inputs[0]
    if node.op_type == "Transpose":
        gather = node.inputs[0].producer()
        squeeze = gather.inputs[0].producer() if gather is not None else None
        if squeeze is not None and squeeze.metadata_props.get(ROW_GATHER_KEY) == "1":
            return squeeze.inputs[0]
    return value
