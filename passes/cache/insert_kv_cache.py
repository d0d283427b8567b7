"""Insert a KV cache into a fused decoder graph, for any model definition.

Runs on canonical ``tfgraph.Attention`` ops (after recognition and bias classification, before
lowering). The graph keeps its inputs and outputs and gains, per causal self-attention layer i
(in graph order):

- inputs ``past_key_values.{i}.key`` / ``.value`` (roles ``past_key`` / ``past_value`` of
  layer i, :mod:`tfgraph.contract`): (batch, kv_heads, past_sequence, head_dim);
- outputs ``present.{i}.key`` / ``.value`` (``present_key`` / ``present_value``): (batch,
  kv_heads, total_sequence, head_dim), the past followed by the new tokens' keys and values
  (what the next step feeds back as past); the canonical op gets ``cached=1``.

Past length 0 is valid, so one graph serves prefill and decode. The ``attention_mask`` input
(by its role) then spans past + new tokens. The cache grows along the sequence axis of the
``token_ids`` input. Cross-attention keys and values (read by a decoder layer's queries,
computed from the encoder alone) are named for :mod:`.split_encoder` by decoder layer.

How positions, masks and biases follow, without knowing how the model computes them:
values are split into

- *token* values: computed from the token inputs (``input_ids``, ``position_ids``, …); their
  sequence axis stays the T new tokens;
- *machinery*: computed from shapes and masks only (position indices, RoPE tables, learned or
  sinusoidal position rows, causal masks, ALiBi and relative biases, padding masks). Every
  length a machinery value took from a token shape becomes L = past + T: the machinery is
  cloned with ``Shape(x)`` of a token value offset by the past length on its sequence axis.

Where machinery meets token data (``Add`` of position rows, ``Mul`` by cos/sin, a bias into the
attention), the clone's query-side sequence axes are sliced to their last T entries: the new
tokens' positions P … L − 1. An attention bias keeps its key axis at L, bottom-right aligned
with the keys ``Concat(past, new)``. Shape arguments of token ops (``Reshape`` targets and the
like) keep T. A bias computed from the tokens (Shaw's ``q·r``, through ``Einsum``/``MatMul``
and elementwise ops) is followed back from the attention's key axis: the machinery it reads
keeps L along the axes that become keys. Positions counted from the token ids (M2M100's
``cumsum(input_ids != pad)``, a cumulative sum of an indicator of the ids) continue from the
past length, as Hugging Face's own cached forward counts them (``+ past_key_values_length``).
A layer that cannot be cached (not causal, an op the
walk cannot follow, unknown shapes) raises :class:`KVCacheError` naming the layer and the
reason (``export`` then writes nothing).
"""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common

from tfgraph import contract
from tfgraph.passes.cache.encoder_mask import add_encoder_mask
from tfgraph.passes.cache.merged_attention_cache import (
    ROWS_REFUSED,
    after_cache,
    cache_reader,
    check_merged,
    merged_cross_kv,
    merged_layers,
    past_shape_source,
)
from tfgraph.passes.cache.row_lengths import (
    PER_ROW,
    ROW_LENGTHS_FROM_KEY,
    ROW_LENGTHS_KEY,
    RowGather,
)
from tfgraph.passes.cache.slice_machinery import Slicer
from tfgraph.passes.cache.split_encoder import CROSS_KV_KEY
from tfgraph.passes.cache.token_value_cache import cache_token_value
from tfgraph.passes.canonical import AttentionOp
from tfgraph.passes.provenance import layer_name
from tfgraph.passes.recognize.attention.gating_softmax import is_gating_softmax
from tfgraph.passes.rewrite_utils import DOMAIN, LOWERED_FROM_KEY, dims_of, int_list, same_dims

logger = logging.getLogger(__name__)

PAST_DIM, TOTAL_DIM = contract.PAST_DIM, contract.TOTAL_DIM
# Inputs of token ops that are shapes, not data: they keep the new tokens' length T.
SHAPE_SLOTS = {
    ("Reshape", 1),
    ("Expand", 1),
    ("Tile", 1),
    ("Pad", 1),
    ("Slice", 1),
    ("Slice", 2),
    ("Slice", 3),
    ("Slice", 4),
    ("Squeeze", 1),
    ("Unsqueeze", 1),
    ("Split", 1),
    ("ConstantOfShape", 0),
    ("Range", 0),
    ("Range", 1),
    ("Range", 2),
}
BIAS_SLOT = 3  # tfgraph.Attention(Q, K, V, bias)
# ops between the token ids and an indicator of them (``input_ids != pad``, as an integer)
_INDICATOR_OPS = {"Equal", "Not", "Cast", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "And"}
_VIEW_OPS = {"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"}  # data in slot 0 only


class KVCacheError(ValueError):
    """The graph cannot take a KV cache; the message names the layer and the reason."""


def _token_input(model: ir.Model, seq: str) -> ir.Value | None:
    """The token input (role ``token_ids``) when it is (batch, sequence)."""
    names = set(contract.names_with_role(model, contract.TOKEN_IDS))
    for value in model.graph.inputs:
        dims = dims_of(value) if value.shape is not None else []
        if value.name in names and len(dims) == 2 and dims[1] == seq:
            return value
    return None


def _is_attention(node: ir.Node) -> bool:
    return node.domain == DOMAIN and node.op_type == "Attention"


def _module(node: ir.Node) -> str:
    return layer_name(node)


def sequence_symbol(model: ir.Model) -> str:
    """The symbol of the axis the cache grows along (axis 1 of the ``token_ids`` input)."""
    by_name = {v.name: v for v in model.graph.inputs}
    for name in contract.names_with_role(model, contract.TOKEN_IDS):
        value = by_name.get(name)
        if value is not None and value.shape is not None and len(value.shape) == 2:
            dim = value.shape[1]
            if isinstance(dim, ir.SymbolicDim) and dim.value:
                return dim.value
    raise KVCacheError(
        "no token input with a dynamic sequence axis (input_ids or decoder_input_ids); "
        "export with a dynamic sequence length"
    )


def _bounded_by(dim, seq: str) -> bool:
    """Whether ``dim`` is ``Min(N, seq)`` (or ``Min(seq, N)``): a buffer of N rows sliced to
    the tokens, which tracing left unnamed (``trace`` names it ``seq`` within the limit)."""
    return isinstance(dim, str) and dim.startswith("Min(") and seq in re.split(r"[(), ]+", dim)


def _has(value: ir.Value | None, seq: str) -> bool:
    return value is not None and value.shape is not None and seq in dims_of(value)


class _Analysis:
    """Token values, machinery values and the cacheable attention layers of a graph."""

    def __init__(self, model: ir.Model, seq: str) -> None:
        graph = model.graph
        self.graph, self.seq = graph, seq
        masks = set(contract.names_with_role(model, contract.ATTENTION_MASK))
        self.masks = [v for v in graph.inputs if v.name in masks and _has(v, seq)]
        roots = [v for v in graph.inputs if _has(v, seq) and v not in self.masks]
        self.token: set[ir.Value] = set(roots)
        self.machinery: set[ir.Value] = set(self.masks)
        for node in graph:  # graph order is topological
            inputs = [v for v in node.inputs if v is not None]
            if node.op_type == "Shape" and node.domain in ("", "ai.onnx"):
                src = inputs[0]
                if src in self.machinery or (src in self.token and self._shape_has_seq(node)):
                    self.machinery.update(node.outputs)
                continue
            if any(v in self.token for v in inputs):
                self.token.update(node.outputs)
            elif any(v in self.machinery for v in inputs):
                self.machinery.update(node.outputs)
        # merged self/cross attention (T5Gemma 2): K = Concat(own, encoder's), cached by its own
        self.merged = merged_layers(self)
        self.layers = [
            n for n in graph if _is_attention(n) and (_has(n.inputs[1], seq) or n in self.merged)
        ]
        self.model = model
        self.key_values: dict[ir.Value, list[int]] = {}  # token values with an L key axis
        # token values read along the key axis, cached like K: {value: [(reader, input)]}
        self.cuts: dict[ir.Value, list[tuple[ir.Node, int]]] = {}
        self.key_reshapes: dict[ir.Node, int] = {}  # Reshape on a bias: its first key axis
        self.id_counts: list[ir.Node] = []  # CumSum of an indicator of the token ids
        self.ids = set(contract.names_with_role(model, contract.TOKEN_IDS))

    def _counts_ids(self, node: ir.Node) -> bool:
        """Whether CumSum ``node`` counts positions from the token ids: forward, inclusive,
        over an indicator computed from a token-id input and constants only."""
        if node.attributes.get_int("exclusive", 0) or node.attributes.get_int("reverse", 0):
            return False
        stack, seen, ids = [node.inputs[0]], set(), False
        while stack:
            value = stack.pop()
            if value is None or value in seen or value.const_value is not None:
                continue
            seen.add(value)
            producer = value.producer()
            if producer is None:
                if value.name not in self.ids:
                    return False
                ids = True
                continue
            if producer.op_type == "Constant":
                continue
            if producer.domain not in ("", "ai.onnx"):
                return False
            if producer.op_type in _VIEW_OPS:  # SpeechT5's input_ids.view(-1, T)
                stack.append(producer.inputs[0])
            elif producer.op_type in _INDICATOR_OPS:
                stack.extend(producer.inputs)
            else:
                return False
        return ids

    def _shape_has_seq(self, node: ir.Node) -> bool:
        src = node.inputs[0]
        if src.shape is None:
            raise KVCacheError(
                f"{_module(node)}: the shape of '{src.name}' is unknown, so its sequence axis "
                "cannot be offset by the past length"
            )
        rank = len(src.shape)
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", rank)
        return self.seq in dims_of(src)[slice(start, end)]

    def _mixes_tokens(self, node: ir.Node) -> str | None:
        """What in ``node`` combines different token positions (outside a canonical
        attention), else None: a convolution or a reduction along the sequence, a cumulative
        sum over it, a product contracting it, or a loop over token values."""
        if node.domain not in ("", "ai.onnx"):
            return None
        data = node.inputs[0] if node.inputs else None
        if data is None or data not in self.token:
            if node.op_type in ("Loop", "Scan") and any(v in self.token for v in node.inputs):
                return f"a {node.op_type} over token values (a recurrence) cannot be followed"
            return None
        if node.op_type in ("Loop", "Scan"):
            return f"a {node.op_type} over token values (a recurrence) cannot be followed"
        outside = "mixes the tokens outside attention"
        if data.shape is None or self.seq not in dims_of(data):
            return None
        dims = dims_of(data)
        axis = dims.index(self.seq)
        if node.op_type in ("Conv", "ConvTranspose") and axis >= 2:
            return (
                f"a {node.op_type} along the sequence {outside} (a convolutional or "
                "recurrent layer: Mamba, linear attention)"
            )
        if node.op_type == "CumSum":
            axes = int_list(node.inputs[1])
            if axes is not None and all(a % len(dims) == axis for a in axes):
                if self._counts_ids(node):  # positions from the ids: they continue
                    if node not in self.id_counts:
                        self.id_counts.append(node)
                    return None
            if axes is None or any(a % len(dims) == axis for a in axes):
                return (
                    "a cumulative sum over the tokens (positions counted from the token ids, "
                    "as M2M100 counts the non-pad tokens, or a recurrent state)"
                )
        if node.op_type.startswith("Reduce"):
            axes = int_list(node.inputs[1]) if len(node.inputs) > 1 else None
            if axes is None:
                axes = node.attributes.get_ints("axes")
            if axes is None or any(a % len(dims) == axis for a in axes):
                return f"a {node.op_type} over the sequence {outside}"
        if node.op_type == "MatMul" and len(dims) >= 2 and dims[-1] == self.seq:
            other = node.inputs[1]
            if other is not None and other in self.token:
                return f"a product contracting the sequence {outside} (linear attention)"
        return None

    def check(self, states: bool = False) -> None:
        """``states``: the graph carries recurrent states (:mod:`.insert_recurrent_state`), so
        it may have no attention layer at all."""
        if not self.layers and not states:
            raise KVCacheError(
                "no fused self-attention over the token sequence: the KV cache needs every "
                "attention layer fused (see the report's fusions.attention.missed)"
            )
        for node in self.graph:
            if (
                node.domain in ("", "ai.onnx")
                and node.op_type == "Softmax"
                and not is_gating_softmax(node)  # a router's softmax over experts
            ):
                if node.inputs[0] in self.token and _has(node.inputs[0], self.seq):
                    raise KVCacheError(
                        f"{_module(node)}: an attention core is not fused (a Softmax over the "
                        "tokens remains); the KV cache needs every attention layer fused"
                    )
            if node.op_type in ("Size",) and any(v in self.token for v in node.inputs):
                raise KVCacheError(f"{_module(node)}: Size of a token tensor is not supported")
            mixing = self._mixes_tokens(node)
            if mixing:
                raise KVCacheError(
                    f"{_module(node)}: {mixing}; a KV cache of the attention layers alone "
                    "would not carry it past the prompt, so export without --kv-cache"
                )
        check_merged(self.model, self, KVCacheError)
        for node in self.layers:
            if node in self.merged:  # checked above
                continue
            q, k, v = node.inputs[:3]
            if not node.attributes.get_int("causal", 0):
                raise KVCacheError(
                    f"{_module(node)}: self-attention over the tokens is not causal, so new "
                    "tokens would change earlier ones; a KV cache does not apply"
                )
            for name, value in (("Q", q), ("K", k), ("V", v)):
                if value.shape is None or len(value.shape) != 4 or dims_of(value)[2] != self.seq:
                    raise KVCacheError(
                        f"{_module(node)}: {name} is not (batch, heads, sequence, head_dim)"
                    )
            for name, value in (("K", k), ("V", v)):
                if not all(isinstance(d, int) for d in dims_of(value)[1::2]):
                    raise KVCacheError(
                        f"{_module(node)}: {name}'s head count or head size is not static"
                    )


def _flattened(dim, seq: str) -> bool:
    """A dim that is an expression of the sequence symbol (``batch*sequence``)."""
    return (
        isinstance(dim, str) and dim != seq and re.search(rf"\b{re.escape(seq)}\b", dim) is not None
    )


def _at_total(dim, seq: str):
    """A clone's dim: the sequence symbol becomes the total length; an expression of it
    (``batch*sequence``, JetMoE's flattened tokens) becomes unknown, not a stale claim that
    ONNX Runtime would plan buffers by."""
    if dim == seq:
        return TOTAL_DIM
    return None if _flattened(dim, seq) else dim


def _shapes_from_tokens(model: ir.Model, seq: str) -> None:
    """``Shape(attention_mask)`` → ``Shape(token_ids)`` where the two agree on every axis read.

    Before the cache both have T positions, and torch.export takes a shared dim from either
    (GPT-2's ``input_ids.view(-1, T)`` may read T off the mask); after it the mask spans
    past + new, so a token op that read T off the mask would get L. Read from the tokens,
    the length is T for token ops and becomes L in the machinery, like any token shape.
    """
    by_name = {v.name: v for v in model.graph.inputs}
    tokens = [
        by_name[n] for n in contract.names_with_role(model, contract.TOKEN_IDS) if n in by_name
    ]
    tokens = [t for t in tokens if _has(t, seq)]
    masks = set(contract.names_with_role(model, contract.ATTENTION_MASK))
    if not tokens:
        return
    token = tokens[0]
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


def _dims_or_none(value: ir.Value, seq: str) -> bool:
    return value.shape is None or seq in dims_of(value)


ELEMENTWISE = {
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Where",
    "Pow",
    "Max",
    "Min",
    "Neg",
    "Cast",
    "Relu",
    "Tanh",
    "Sigmoid",
    "Identity",
    "Abs",
    "Exp",
    "Log",
    "Sqrt",
    "Reciprocal",
    "Softplus",
    "Clip",
    "Not",
    "And",
    "Or",
    "Equal",
    "Greater",
    "Less",
    "GreaterOrEqual",
    "LessOrEqual",
}


def _input_key_axes(
    node: ir.Node, index: int, value: ir.Value, out_keys: list[int], out_rank: int, seq: str
) -> list[int]:
    """Axes of input ``index`` that feed the output's key axes (the attention's S axis)."""
    rank = len(value.shape)
    op = node.op_type
    if op in ELEMENTWISE:
        shift = out_rank - rank
        return [a - shift for a in out_keys if a - shift >= 0 and dims_of(value)[a - shift] != 1]
    if op == "Transpose":
        perm = node.attributes.get_ints("perm", list(reversed(range(rank))))
        return [perm[a] for a in out_keys]
    if op in ("Squeeze", "Unsqueeze") and index == 0:
        axes = int_list(node.inputs[1]) if len(node.inputs) > 1 else None
        if axes is not None:
            if op == "Squeeze":
                kept = [i for i in range(rank) if i not in {a % rank for a in axes}]
                return [kept[a] for a in out_keys]
            added = {a % out_rank for a in axes}
            return [a - sum(b < a for b in added) for a in out_keys if a not in added]
    if op in ("Reshape", "Expand") and index > 0:  # a shape
        return []
    if op == "Expand":  # broadcast like an elementwise op
        shift = out_rank - rank
        return [a - shift for a in out_keys if a - shift >= 0 and dims_of(value)[a - shift] != 1]
    if op == "Reshape":  # keys kept where the dims from the key axis on are unchanged
        out_dims = dims_of(node.outputs[0])
        mapped = []
        for a in out_keys:
            tail = out_rank - a
            if tail <= rank and same_dims(dims_of(value)[rank - tail :], out_dims[a:]):
                mapped.append(rank - tail)
            else:
                raise KVCacheError(
                    f"{_module(node)}: the attention bias is reshaped across its key axis, "
                    "which the KV cache cannot follow"
                )
        return mapped
    if op == "GatherND" and not node.attributes.get_int("batch_dims", 0):
        # data[indices[..., :]] (Hugging Face's padding_mask[b, kv_idx]): the indices' leading
        # axes are the output's; the data's sequence axis is what they address
        if index == 1:
            return list(out_keys)
        return [i for i, d in enumerate(dims_of(value)) if d == seq] if out_keys else []
    if op == "GatherElements":  # keys gathered along its axis come from the indices
        axis = node.attributes.get_int("axis", 0) % rank
        if index > 0:
            return list(out_keys)
        gathered = dims_of(value)[axis]  # a fixed table (Inkling's relative extent), or keys
        keyed = axis in out_keys and (gathered == seq or _flattened(gathered, seq))
        return [a for a in out_keys if a != axis] + ([axis] if keyed else [])
    if op == "ScatterElements":  # data as the output; indices and updates select key slots
        return list(out_keys)
    if op == "TopK":  # the keys it selects from (its k is a count)
        axis = node.attributes.get_int("axis", -1) % rank
        return [axis] if axis in out_keys and index == 0 else []
    if op == "MatMul":
        batch = [a for a in out_keys if a < out_rank - 2]
        shift = out_rank - rank
        mapped = [a - shift for a in batch if a - shift >= 0]
        if index == 0:
            return mapped + ([rank - 2] if out_rank - 2 in out_keys else [])
        return mapped + ([rank - 1] if out_rank - 1 in out_keys else [])
    if op == "Einsum":
        inputs, output = node.attributes.get_string("equation").replace(" ", "").split("->")
        letters = inputs.split(",")[index]
        keys = {output[a] for a in out_keys}
        return [i for i, letter in enumerate(letters) if letter in keys]
    raise KVCacheError(
        f"{_module(node)}: the attention bias is computed from the tokens through {op}, "
        "which the KV cache cannot follow"
    )


def _key_axes(analysis: _Analysis) -> dict[tuple[ir.Node, int], list[int]]:
    """For a bias computed from the tokens (Shaw's ``q·r``): walk back from each attention's
    bias and find, per machinery input on the way, the axes that become the key axis. Those
    keep length L; the token values on the way get an L key axis too
    (``analysis.key_values``). A token value whose only sequence axes become keys (DSA's
    indexer keys, read by a ``MatMul`` with the queries) is cached like K
    (``analysis.cuts``): the walk stops there. Top-k indices (``TopK`` into
    ``ScatterElements``) select key slots: walked through whatever their length."""
    keys: dict[ir.Value, list[int]] = {}
    selections: set[ir.Value] = set()  # values whose key axes hold selected key positions
    for node in analysis.layers:
        bias = node.inputs[BIAS_SLOT] if len(node.inputs) > BIAS_SLOT else None
        if bias is not None and bias in analysis.token and _has(bias, analysis.seq):
            if dims_of(bias)[-1] == analysis.seq:
                keys[bias] = [len(bias.shape) - 1]
    junctions: dict[tuple[ir.Node, int], list[int]] = {}
    for node in reversed(list(analysis.graph)):
        out = next((o for o in node.outputs if o in keys), None)
        if out is None or _is_attention(node):
            continue
        for index, value in enumerate(node.inputs):
            if value is None or (value not in analysis.token and value not in analysis.machinery):
                continue
            if value.shape is None:
                raise KVCacheError(f"{_module(node)}: the shape of '{value.name}' is unknown")
            mapped = _input_key_axes(node, index, value, keys[out], len(out.shape), analysis.seq)
            if node.op_type == "Reshape" and index == 0 and mapped:
                analysis.key_reshapes[node] = min(keys[out])  # its target's tail reads L
            dims = dims_of(value)
            axes = [a for a in mapped if dims[a] == analysis.seq]
            selects = (node.op_type == "ScatterElements" and index > 0) or (
                out in selections and node.op_type != "TopK"
            )
            if selects and mapped and value in analysis.token:
                selections.add(value)
                keys[value] = sorted(set(keys.get(value, [])) | set(mapped))
                continue
            derived = next((dims[a] for a in mapped if _flattened(dims[a], analysis.seq)), None)
            if derived is not None and not selects:
                raise KVCacheError(
                    f"{_module(node)}: the attention bias reads '{value.name}' along an axis of "
                    f"{derived} (keys pooled into blocks), which the KV cache cannot follow"
                )
            if value in analysis.machinery and (axes or (selects and mapped)):
                # a count of selected keys (``Min(k, sequence)``) is a key axis too
                junctions[(node, index)] = sorted(set(axes) | set(mapped if selects else []))
            elif not axes:
                continue
            elif (
                value.producer() is not None
                and value.producer().op_type != "GatherND"  # addresses its data by position
                and axes == [i for i, d in enumerate(dims) if d == analysis.seq]
            ):
                analysis.cuts.setdefault(value, []).append((node, index))
            elif value.producer() is None:
                raise KVCacheError(
                    f"{_module(node)}: the attention bias needs input '{value.name}' for past "
                    "tokens, which the cache does not keep"
                )
            else:
                keys[value] = sorted(set(keys.get(value, [])) | set(axes))
    analysis.key_values = {
        v: [a for a in axes if dims_of(v)[a] == analysis.seq] for v, axes in keys.items()
    }
    return junctions


class _Rewriter:
    """Clones machinery at length L = past + T and rewires junctions to its last T rows."""

    def __init__(self, analysis: _Analysis, past_len: ir.Value) -> None:
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
                f"{_module(node)}: position or mask computation inside control flow "
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
                new.shape = ir.Shape([_at_total(d, self.a.seq) for d in dims_of(old)])
            if old.name:
                new.name = f"{old.name}__total"
            self.memo[old] = new
        self.pending.append(clone)
        return self.memo[value]

    def last_rows(self, value: ir.Value, axes: list[int]) -> ir.Value:
        """``value`` at L, cut to its last T entries along ``axes``: the cut is pushed toward
        the machinery's sources, so only the new rows are computed (:mod:`.slice_machinery`)."""
        return self.slicer.last_rows(value, axes)


class InsertKVCachePass(ir.passes.InPlacePass):
    """Give every causal self-attention layer past/present KV (see the module docstring).

    ``modified`` is False only for a graph that already has ``past_key_values`` inputs.
    Raises :class:`KVCacheError` when a layer cannot be cached. The layer checks run first;
    a few cases (control flow in a mask computation, a value without a shape) only show while
    rewriting, and leave the graph partly rewritten: callers abandon it (``export`` writes
    nothing).
    """

    def __init__(self, row_lengths: bool = False) -> None:
        super().__init__()
        # junctions gathered per row (rows of a batch at different past lengths, in-flight
        # batching) instead of sliced to the last T rows: :mod:`.row_lengths`
        self.row_lengths = row_lengths

    def requires(self, model: ir.Model) -> None:
        lowered = [n for n in model.graph if n.metadata_props.get(LOWERED_FROM_KEY) == "Attention"]
        if lowered:
            raise ir.passes.PreconditionError(
                f"the KV cache goes on canonical tfgraph.Attention, but attention is lowered "
                f"already ({lowered[0].op_type}): run InsertKVCachePass before LowerAttentionPass"
            )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if contract.names_with_role(model, contract.PAST_KEY, contract.PAST_VALUE):
            return ir.passes.PassResult(model, modified=False)
        seq = sequence_symbol(model)
        common.ShapeInferencePass()(model)  # shapes of values the fusion passes created
        _shapes_from_tokens(model, seq)
        analysis = _Analysis(model, seq)
        states = contract.names_with_role(model, *contract.STATE_ROLES)
        analysis.check(states=bool(states))
        junction_keys = _key_axes(analysis)
        if analysis.cuts and not analysis.layers:
            raise KVCacheError("token values read along the key axis need an attention layer")
        if not analysis.layers:  # recurrent layers only: the mask still spans past + new
            return self._states_only(model, analysis, seq, junction_keys)
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
                graph.inputs.append(past)
                contract.set_role(model, past.name, role, i)
                pasts.append(past)
        shape_node = ir.node("Shape", [pasts[0]], {"start": 2, "end": 3})
        graph.insert_before(next(iter(graph)), shape_node)
        rewriter = _Rewriter(analysis, shape_node.outputs[0])
        rows = None
        if self.row_lengths and states:
            model.metadata_props[ROW_LENGTHS_KEY] = (
                "recurrent layers carry one state per row: a slot cannot join mid-batch"
            )
        elif self.row_lengths and analysis.cuts:
            model.metadata_props[ROW_LENGTHS_KEY] = (
                "a bias reads cached token values (an indexer's keys) of one past length"
            )
        elif self.row_lengths:
            tokens = _token_input(model, seq)
            if tokens is None:
                model.metadata_props[ROW_LENGTHS_KEY] = "no token input with a batch axis"
            else:
                rows = RowGather(rewriter, tokens, shape_node.outputs[0])
                graph.insert_after(shape_node, rows.nodes)
                if analysis.merged:
                    rows.refuse(ROWS_REFUSED)
        self._junctions(model, analysis, rewriter, rows, junction_keys, seq)
        for i, (value, readers) in enumerate(analysis.cuts.items()):
            try:
                cache_token_value(model, value, readers, seq, i)
            except ValueError as exc:
                raise KVCacheError(f"{_module(value.producer())}: {exc}") from None
        for node, axis in analysis.key_reshapes.items():
            _target_tail_from_input(graph, node, axis)
        # K and V: the past, then the new tokens; the concatenation is the present.
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
        _name_cross_kv(model, analysis)
        if rows is not None:  # slots pad their cross K/V: the step graph masks the padding
            add_encoder_mask(model)
        if rows is not None:
            model.metadata_props[ROW_LENGTHS_KEY] = rows.refused or PER_ROW
            if not rows.refused:  # for the kernels, should the cleanup remove them
                graph.metadata_props[ROW_LENGTHS_FROM_KEY] = f"{rows.tokens.name}\n{pasts[0].name}"
            if rows.refused:
                logger.info("KV cache without per-row lengths: %s", rows.refused)
        for mask in analysis.masks:
            mask.shape = ir.Shape([TOTAL_DIM if d == seq else d for d in dims_of(mask)])
        logger.info(
            "KV cache inserted for %d attention layers (%d machinery ops compute only the new "
            "rows)",
            len(analysis.layers),
            rewriter.slicer.pushed,
        )
        return ir.passes.PassResult(model, modified=True)

    def _states_only(self, model: ir.Model, analysis: _Analysis, seq: str, junction_keys):
        """A graph of recurrent layers only: no KV, but the padding mask (which the layers
        apply to their inputs) spans past + new like any cached graph's; the past length is
        the mask's length less the new tokens'."""
        graph = model.graph
        tokens = _token_input(model, seq)
        if not analysis.masks or tokens is None:
            return ir.passes.PassResult(model, modified=False)
        total = ir.node("Shape", [analysis.masks[0]], {"start": 1, "end": 2})
        new = ir.node("Shape", [tokens], {"start": 1, "end": 2})
        past = ir.node("Sub", [total.outputs[0], new.outputs[0]])
        graph.insert_before(next(iter(graph)), [total, new, past])
        rewriter = _Rewriter(analysis, past.outputs[0])
        if self.row_lengths:
            model.metadata_props[ROW_LENGTHS_KEY] = (
                "recurrent layers carry one state per row: a slot cannot join mid-batch"
            )
        self._junctions(model, analysis, rewriter, None, junction_keys, seq)
        for mask in analysis.masks:
            mask.shape = ir.Shape([TOTAL_DIM if d == seq else d for d in dims_of(mask)])
        logger.info("padding mask over past + new tokens for a recurrent-only graph")
        return ir.passes.PassResult(model, modified=True)

    def _junctions(self, model, analysis, rewriter, rows, junction_keys, seq) -> None:
        graph = model.graph
        if analysis.id_counts and rows is not None:
            rows.refuse(
                f"{_module(analysis.id_counts[0])}: positions counted from the token ids "
                "continue from one past length for the whole batch"
            )
        for node in analysis.id_counts:
            _continue_count(graph, node, rewriter.past_len)
        for value, axes in analysis.key_values.items():  # a token bias now spans L keys
            value.shape = ir.Shape(
                [TOTAL_DIM if i in axes else d for i, d in enumerate(dims_of(value))]
            )
        # Junctions: token ops reading machinery in a data slot get its last T rows (or, with
        # per-row lengths, each row's own rows).
        junctions = []
        for node in list(graph):
            if not any(o in analysis.token for o in node.outputs):
                continue
            for index, value in enumerate(node.inputs):
                if value is None or value not in analysis.machinery:
                    continue
                if (node.op_type, index) in SHAPE_SLOTS and node.domain in ("", "ai.onnx"):
                    continue
                if value.shape is None:
                    raise KVCacheError(
                        f"{_module(node)}: the shape of '{value.name}' is unknown, so its "
                        "sequence axes cannot be told apart"
                    )
                dims = dims_of(value)
                key_axes = junction_keys.get((node, index), [])
                bounded = next(
                    (d for i, d in enumerate(dims) if _bounded_by(d, seq) and i not in key_axes),
                    None,
                )
                if bounded is not None:
                    raise KVCacheError(
                        f"{_module(node)}: '{value.name}' has a sequence axis of {bounded} (a "
                        "buffer sliced to the input), so its rows cannot be told apart from "
                        "the new tokens; state the model's position limit (a config with "
                        "max_position_embeddings) so that the axis is the sequence"
                    )
                if _is_attention(node) and index == BIAS_SLOT:
                    key_axes = [len(dims) - 1]  # keys stay at L
                axes = [i for i, d in enumerate(dims) if d == seq and i not in key_axes]
                if _is_attention(node) and index == BIAS_SLOT and not axes and len(dims) > 1:
                    # an attention bias is (…, T or 1, S or 1): a query axis that shape
                    # inference lost (a position table sliced to the length, HF MPT's ALiBi)
                    # is still the queries
                    if not isinstance(dims[-2], int):
                        axes = [len(dims) - 2]
                if not axes and not key_axes and any(_flattened(d, seq) for d in dims):
                    # the tokens flattened into one axis (JetMoE's (batch·T, experts) router
                    # buffer): no axis to slice, and its T-length original is what the token
                    # op read before the cache (cache parity checks it)
                    continue
                junctions.append((node, index, value, axes))
        if rows is not None:  # per-row lengths for every junction, or for none
            for node, index, value, axes in junctions:
                why = rows.why_not(node, index, value, axes, seq) if axes else None
                if why is not None:
                    rows.refuse(f"{_module(node)}: {why}")
                    break
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


def _target_tail_from_input(graph: ir.Graph, node: ir.Node, axis: int) -> None:
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


def _continue_count(graph: ir.Graph, node: ir.Node, past_len: ir.Value) -> None:
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
        raise KVCacheError(f"{_module(node)}: a position count is a graph output")


def _name_cross_kv(model: ir.Model, analysis: _Analysis) -> None:
    """Name the K and V of each cross-attention (queries from the decoder's tokens, keys and
    values from the encoder only) by decoder layer, so that :func:`.split_encoder.split_encoder`
    can cut the graph there. Decoder layer i is the one whose self-attention (cached layer i)
    precedes it (where decoder layers do not have one each, they are numbered in graph order);
    an encoder's own self-attention is not a cross-attention and stays inside."""
    found: list[tuple[int, ir.Value, ir.Value]] = []  # (decoder layer, K, V)
    layer = -1
    cached = set(map(id, analysis.layers))
    for node in model.graph:
        if not _is_attention(node):
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
