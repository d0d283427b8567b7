"""What the KV cache pass reads off a graph before it rewrites anything.

:class:`Analysis` splits the values of a fused graph into *token* values (computed from the
token inputs; their sequence axis stays the T new tokens) and *machinery* (computed from
shapes and masks only: positions, RoPE tables, masks, position biases), finds the attention
layers over the token sequence, and :meth:`Analysis.check` refuses a graph the cache cannot
carry (an unfused attention core, a recurrence over the tokens, a non-causal layer, …) with a
:class:`KVCacheError` naming the layer. :mod:`.insert_kv_cache` runs it; :mod:`.kv_junctions`
and :mod:`.kv_rewrite` read it.
"""

from __future__ import annotations

import re

import onnx_ir as ir

from tfgraph import contract
from tfgraph.passes.cache.merged_attention_cache import check_merged, merged_layers
from tfgraph.passes.provenance import layer_name
from tfgraph.passes.recognize.attention.gating_softmax import is_gating_softmax
from tfgraph.passes.rewrite_utils import DOMAIN, dims_of, int_list

BIAS_SLOT = 3  # tfgraph.Attention(Q, K, V, bias)
# ops between the token ids and an indicator of them (``input_ids != pad``, as an integer)
_INDICATOR_OPS = {"Equal", "Not", "Cast", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "And"}
_VIEW_OPS = {"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"}  # data in slot 0 only


class KVCacheError(ValueError):
    """The graph cannot take a KV cache; the message names the layer and the reason."""


def token_input(model: ir.Model, seq: str) -> ir.Value | None:
    """The token input (role ``token_ids``) when it is (batch, sequence)."""
    names = set(contract.names_with_role(model, contract.TOKEN_IDS))
    for value in model.graph.inputs:
        dims = dims_of(value) if value.shape is not None else []
        if value.name in names and len(dims) == 2 and dims[1] == seq:
            return value
    return None


def is_attention(node: ir.Node) -> bool:
    """A canonical ``tfgraph.Attention``."""
    return node.domain == DOMAIN and node.op_type == "Attention"


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


def bounded_by(dim, seq: str) -> bool:
    """Whether ``dim`` is ``Min(N, seq)`` (or ``Min(seq, N)``): a buffer of N rows sliced to
    the tokens, which tracing left unnamed (``trace`` names it ``seq`` within the limit)."""
    return isinstance(dim, str) and dim.startswith("Min(") and seq in re.split(r"[(), ]+", dim)


def has_seq(value: ir.Value | None, seq: str) -> bool:
    """Whether ``value`` has a known shape with the sequence axis ``seq`` in it."""
    return value is not None and value.shape is not None and seq in dims_of(value)


def flattened(dim, seq: str) -> bool:
    """A dim that is an expression of the sequence symbol (``batch*sequence``)."""
    return (
        isinstance(dim, str) and dim != seq and re.search(rf"\b{re.escape(seq)}\b", dim) is not None
    )


class Analysis:
    """Token values, machinery values and the cacheable attention layers of a graph."""

    def __init__(self, model: ir.Model, seq: str) -> None:
        graph = model.graph
        self.graph, self.seq = graph, seq
        masks = set(contract.names_with_role(model, contract.ATTENTION_MASK))
        self.masks = [v for v in graph.inputs if v.name in masks and has_seq(v, seq)]
        roots = [v for v in graph.inputs if has_seq(v, seq) and v not in self.masks]
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
            n for n in graph if is_attention(n) and (has_seq(n.inputs[1], seq) or n in self.merged)
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
                f"{layer_name(node)}: the shape of '{src.name}' is unknown, so its sequence axis "
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
                if node.inputs[0] in self.token and has_seq(node.inputs[0], self.seq):
                    raise KVCacheError(
                        f"{layer_name(node)}: an attention core is not fused (a Softmax over the "
                        "tokens remains); the KV cache needs every attention layer fused"
                    )
            if node.op_type in ("Size",) and any(v in self.token for v in node.inputs):
                raise KVCacheError(f"{layer_name(node)}: Size of a token tensor is not supported")
            mixing = self._mixes_tokens(node)
            if mixing:
                raise KVCacheError(
                    f"{layer_name(node)}: {mixing}; a KV cache of the attention layers alone "
                    "would not carry it past the prompt, so export without --kv-cache"
                )
        check_merged(self.model, self, KVCacheError)
        for node in self.layers:
            if node in self.merged:  # checked above
                continue
            q, k, v = node.inputs[:3]
            # prompt_block: causal but where the step's own ids open a block (its bias, kept,
            # is computed from the new tokens: cached as any kept causal bias)
            block = node.attributes.get_string("bias_kind", "none") == "prompt_block"
            if not node.attributes.get_int("causal", 0) and not block:
                raise KVCacheError(
                    f"{layer_name(node)}: self-attention over the tokens is not causal, so new "
                    "tokens would change earlier ones; a KV cache does not apply"
                )
            for name, value in (("Q", q), ("K", k), ("V", v)):
                if value.shape is None or len(value.shape) != 4 or dims_of(value)[2] != self.seq:
                    raise KVCacheError(
                        f"{layer_name(node)}: {name} is not (batch, heads, sequence, head_dim)"
                    )
            for name, value in (("K", k), ("V", v)):
                if not all(isinstance(d, int) for d in dims_of(value)[1::2]):
                    raise KVCacheError(
                        f"{layer_name(node)}: {name}'s head count or head size is not static"
                    )
