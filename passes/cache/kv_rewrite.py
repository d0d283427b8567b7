"""The KV cache pass's rewrites: past inputs, present outputs, machinery at the total length.

:mod:`.insert_kv_cache` runs them in order on what :mod:`.kv_analysis` and
:mod:`.kv_junctions` found: each cached layer gets inputs ``past_key_values.{i}.key`` /
``.value`` and outputs ``present.{i}.*`` = ``Concat(past, new)``; the machinery is cloned at
L = past + T (:class:`Rewriter`) and every junction reads its last T rows (or, with per-row
lengths, each row's own rows, :mod:`.row_lengths`); positions counted from the token ids
continue from the past length; cross-attention K/V are named for :mod:`.split_encoder`.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from tfgraph import contract
from tfgraph.passes.cache.kv_analysis import (
    Analysis,
    KVCacheError,
    flattened,
    has_seq,
    is_attention,
)
from tfgraph.passes.cache.kv_junctions import Junction
from tfgraph.passes.cache.merged_attention_cache import (
    after_cache,
    cache_reader,
    merged_cross_kv,
    past_shape_source,
)
from tfgraph.passes.cache.row_lengths import RowGather
from tfgraph.passes.cache.slice_machinery import Slicer
from tfgraph.passes.cache.split_encoder import CROSS_KV_KEY
from tfgraph.passes.canonical import AttentionOp
from tfgraph.passes.provenance import layer_name
from tfgraph.passes.rewrite_utils import dims_of

PAST_DIM, TOTAL_DIM = contract.PAST_DIM, contract.TOTAL_DIM


def at_total(dim, seq: str):
    """A clone's dim: the sequence symbol becomes the total length; an expression of it
    (``batch*sequence``, JetMoE's flattened tokens) becomes unknown, not a stale claim that
    ONNX Runtime would plan buffers by."""
    if dim == seq:
        return TOTAL_DIM
    return None if flattened(dim, seq) else dim


def shapes_from_tokens(model: ir.Model, seq: str) -> int:
    """``Shape(attention_mask)`` → ``Shape(token_ids)`` where the two agree on every axis read;
    the number of ``Shape`` nodes rewired.

    Before the cache both have T positions, and torch.export takes a shared dim from either
    (GPT-2's ``input_ids.view(-1, T)`` may read T off the mask); after it the mask spans
    past + new, so a token op that read T off the mask would get L. Read from the tokens,
    the length is T for token ops and becomes L in the machinery, like any token shape.
    """
    by_name = {v.name: v for v in model.graph.inputs}
    tokens = [
        by_name[n] for n in contract.names_with_role(model, contract.TOKEN_IDS) if n in by_name
    ]
    tokens = [t for t in tokens if has_seq(t, seq)]
    masks = set(contract.names_with_role(model, contract.ATTENTION_MASK))
    if not tokens:
        return 0
    token = tokens[0]
    rewired = 0
    for node in model.graph:
        if node.op_type != "Shape" or node.domain not in ("", "ai.onnx"):
            continue
        src = node.inputs[0]
        if src is None or src.name not in masks or src.shape is None:
            continue
        rank = len(src.shape)
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", rank)
        if len(token.shape) == rank and dims_of(src)[start:end] == dims_of(token)[start:end]:
            node.replace_input_with(0, token)
            rewired += 1
    return rewired


class Rewriter:
    """Clones machinery at length L = past + T and rewires junctions to its last T rows."""

    def __init__(self, analysis: Analysis, past_len: ir.Value) -> None:
        self.a, self.past_len = analysis, past_len
        self.memo: dict[ir.Value, ir.Value] = {m: m for m in analysis.masks}
        self.pending: list[ir.Node] = []
        self._consts = 0
        self.slicer = Slicer(self, TOTAL_DIM)

    def const(self, array: np.ndarray) -> ir.Value:
        self._consts += 1
        node = ir.node("Constant", [], {"value": ir.tensor(array, name=f"kv_c{self._consts}")})
        self.pending.append(node)
        return node.outputs[0]

    def add(self, op: str, inputs: list, attributes: dict | None = None) -> ir.Value:
        node = ir.node(op, inputs, attributes or {})
        self.pending.append(node)
        return node.outputs[0]

    def full(self, value: ir.Value) -> ir.Value:
        """``value`` recomputed with every token length T replaced by L."""
        if value in self.memo:
            return self.memo[value]
        node = value.producer()
        if node is None:  # a graph input that is machinery is a mask: already at L
            return value
        if node.op_type == "Shape" and node.inputs[0] in self.a.token:
            src = node.inputs[0]
            rank = len(src.shape)
            start = node.attributes.get_int("start", 0) % (rank or 1)
            end = node.attributes.get_int("end", rank)
            end = end % rank if end < 0 else min(end, rank)
            onehot = np.array([int(d == self.a.seq) for d in dims_of(src)[start:end]], np.int64)
            offset = self.add("Mul", [self.const(onehot), self.past_len])
            out = self.add("Add", [value, offset])
            self.memo[value] = out
            return out
        if any(
            attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
            for attr in node.attributes.values()
        ):
            raise KVCacheError(
                f"{layer_name(node)}: position or mask computation inside control flow "
                f"({node.op_type}) is not supported"
            )
        inputs = [
            self.full(v) if v is not None and v in self.a.machinery else v for v in node.inputs
        ]
        clone = ir.Node(
            node.domain,
            node.op_type,
            inputs,
            attributes=[ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()],
            num_outputs=len(node.outputs),
            version=node.version,
            name=f"{node.name}__total" if node.name else None,
            metadata_props=dict(node.metadata_props),
        )
        for old, new in zip(node.outputs, clone.outputs, strict=True):
            new.type = old.type
            if old.shape is not None:
                new.shape = ir.Shape([at_total(d, self.a.seq) for d in dims_of(old)])
            if old.name:
                new.name = f"{old.name}__total"
            self.memo[old] = new
        self.pending.append(clone)
        return self.memo[value]

    def last_rows(self, value: ir.Value, axes: list[int]) -> ir.Value:
        """``value`` at L, cut to its last T entries along ``axes``: the cut is pushed toward
        the machinery's sources, so only the new rows are computed (:mod:`.slice_machinery`)."""
        return self.slicer.last_rows(value, axes)


def target_tail_from_input(graph: ir.Graph, node: ir.Node, axis: int) -> None:
    """A ``Reshape`` of a bias that keeps its dims from key ``axis`` on (``repeat_kv`` of a
    mask): its target's tail, a T where the keys are now L, is read off the input instead."""
    data, target = node.inputs[0], node.inputs[1]
    tail = len(node.outputs[0].shape) - axis
    shape = ir.node("Shape", [data], {"start": len(data.shape) - tail})
    starts = ir.node("Constant", [], {"value": ir.tensor(np.array([0], np.int64))})
    ends = ir.node("Constant", [], {"value": ir.tensor(np.array([axis], np.int64))})
    head = ir.node("Slice", [target, starts.outputs[0], ends.outputs[0]])
    joined = ir.node("Concat", [head.outputs[0], shape.outputs[0]], {"axis": 0})
    added = [shape, starts, ends, head, joined]
    for new in added:
        new.metadata_props.update(node.metadata_props)
    graph.insert_before(node, added)
    node.replace_input_with(1, joined.outputs[0])


def continue_count(graph: ir.Graph, node: ir.Node, past_len: ir.Value) -> None:
    """``CumSum(indicator of the ids)`` + the past length: the count continues past the
    cached tokens, as Hugging Face's ``create_position_ids_from_input_ids(…,
    past_key_values_length)`` counts them (every cached token counted, padded or not)."""
    out = node.outputs[0]
    uses = list(out.uses())  # before the Add below reads it too
    cast = ir.node("Cast", [past_len], {"to": out.dtype or ir.DataType.INT64})
    add = ir.node("Add", [out, cast.outputs[0]])
    add.outputs[0].type, add.outputs[0].shape = out.type, out.shape
    for added in (cast, add):
        added.metadata_props.update(node.metadata_props)
    graph.insert_after(node, [cast, add])
    for use in uses:
        use.node.replace_input_with(use.idx, add.outputs[0])
    if out.is_graph_output():
        raise KVCacheError(f"{layer_name(node)}: a position count is a graph output")


def name_cross_kv(model: ir.Model, analysis: Analysis) -> None:
    """Name the K and V of each cross-attention (queries from the decoder's tokens, keys and
    values from the encoder only) by decoder layer, so that :func:`.split_encoder.split_encoder`
    can cut the graph there. Decoder layer i is the one whose self-attention (cached layer i)
    precedes it (where decoder layers do not have one each, they are numbered in graph order);
    an encoder's own self-attention is not a cross-attention and stays inside."""
    found: list[tuple[int, ir.Value, ir.Value]] = []  # (decoder layer, K, V)
    layer = -1
    cached = set(map(id, analysis.layers))
    for node in model.graph:
        if not is_attention(node):
            continue
        if id(node) in cached:
            layer += 1
            encoder_kv = merged_cross_kv(analysis, node)  # a merged layer's encoder part
            if encoder_kv is not None:
                found.append((layer, *encoder_kv))
            continue
        q, k, v = node.inputs[0], node.inputs[1], node.inputs[2]
        if q not in analysis.token:  # an encoder layer's self-attention
            continue
        if any(x in analysis.token or x in analysis.machinery for x in (k, v)):
            continue
        if any(
            x.is_graph_input() or x.is_graph_output() or x.const_value is not None for x in (k, v)
        ):
            continue
        found.append((layer, k, v))
    layers = [layer for layer, _, _ in found]
    if any(i < 0 for i in layers) or len(set(layers)) != len(layers):
        layers = list(range(len(found)))  # not one per decoder layer: numbered in graph order
    entries = []
    for i, (_, k, v) in zip(layers, found, strict=True):
        for role, value in ((contract.CROSS_KEY, k), (contract.CROSS_VALUE, v)):
            value.name = contract.tensor_name(role, i)
            entries.append([value.name, role, i])
    if entries:
        model.metadata_props[CROSS_KV_KEY] = json.dumps(entries)


def add_pasts(model: ir.Model, analysis: Analysis) -> list[ir.Value]:
    """Inputs ``past_key_values.{i}.key`` / ``.value`` of every cached layer i, with their
    roles: (batch, kv_heads, past_sequence, head_dim) like the layer's K and V."""
    pasts = []
    for i, node in enumerate(analysis.layers):
        k, v = past_shape_source(analysis, node, 1), past_shape_source(analysis, node, 2)
        for role, value in ((contract.PAST_KEY, k), (contract.PAST_VALUE, v)):
            batch, heads, _, size = dims_of(value)  # V's heads may be narrower (MLA)
            past = ir.Value(
                name=contract.tensor_name(role, i),
                type=value.type,
                shape=ir.Shape([batch, heads, PAST_DIM, size]),
            )
            model.graph.inputs.append(past)
            contract.set_role(model, past.name, role, i)
            pasts.append(past)
    return pasts


def refuse_rows(rows: RowGather | None, junctions: list[Junction], seq: str) -> None:
    """Per-row lengths for every junction, or for none: the first junction that cannot be
    gathered per row refuses them all."""
    if rows is None:
        return
    for node, index, value, axes in junctions:
        why = rows.why_not(node, index, value, axes, seq) if axes else None
        if why is not None:
            rows.refuse(f"{layer_name(node)}: {why}")
            break


def rewire_junctions(
    graph: ir.Graph, rewriter: Rewriter, rows: RowGather | None, junctions: list[Junction]
) -> None:
    """Each junction reads the machinery at L cut to the new tokens: its last T rows, or (with
    per-row lengths) each row's own rows, shifted where the machinery is a function of i − j."""
    seq = rewriter.a.seq
    for node, index, value, axes in junctions:
        rewriter.pending.clear()
        if rows is not None and rows.refused is None and axes:
            if rows.shifts(node, index):  # a function of i − j: the slice, shifted
                if rows.pads(node):  # …that also reads the mask: the mask left-padded
                    sliced = rows.left_padded(rewriter, value, axes, seq)
                else:
                    sliced = rewriter.last_rows(value, axes)
                new = rows.shifted(sliced, rewriter.past_len)
            else:
                new = rows.rows(node, rewriter.full(value), value, axes, seq)
        else:
            new = rewriter.last_rows(value, axes)
        graph.insert_before(node, rewriter.pending)
        for added in rewriter.pending:
            for key, prop in node.metadata_props.items():
                added.metadata_props.setdefault(key, prop)
        node.replace_input_with(index, new)


def widen_key_values(analysis: Analysis) -> None:
    """Token values on a bias's way to the keys (:func:`.kv_junctions.key_axes`) now span L
    keys along those axes."""
    for value, axes in analysis.key_values.items():
        value.shape = ir.Shape(
            [TOTAL_DIM if i in axes else d for i, d in enumerate(dims_of(value))]
        )


def widen_masks(analysis: Analysis) -> None:
    """The attention mask inputs span past + new tokens."""
    for mask in analysis.masks:
        mask.shape = ir.Shape([TOTAL_DIM if d == analysis.seq else d for d in dims_of(mask)])


def add_presents(model: ir.Model, analysis: Analysis, pasts: list[ir.Value]) -> None:
    """K and V: the past, then the new tokens; the concatenation is the present (an output,
    ``present.{i}.key`` / ``.value``). A cached layer's causal alignment becomes bottom-right."""
    graph, seq = model.graph, analysis.seq
    for i, node in enumerate(analysis.layers):
        # Q and K shared the sequence axis, where both causal alignments coincide; with a
        # past, the new queries follow it: bottom-right (SDPA's is_causal is top-left)
        if node not in analysis.merged:  # a merged layer's K is not Concat(past, new)
            spec = AttentionOp.read(node)
            spec.replace(cached=True, causal_alignment="bottom_right").write(node)
        for slot, past, role in (
            (1, pasts[2 * i], contract.PRESENT_KEY),
            (2, pasts[2 * i + 1], contract.PRESENT_VALUE),
        ):
            present = contract.tensor_name(role, i)
            contract.set_role(model, present, role, i)
            reader, index = cache_reader(analysis, node, slot)
            new = reader.inputs[index]
            concat = ir.node("Concat", [past, new], {"axis": 2})
            out = concat.outputs[0]
            out.name, out.type = present, new.type
            out.shape = ir.Shape([TOTAL_DIM if d == seq else d for d in dims_of(new)])
            concat.metadata_props.update(node.metadata_props)
            graph.insert_before(reader, concat)
            reader.replace_input_with(index, out)
            graph.outputs.append(out)
        after_cache(analysis, node)
