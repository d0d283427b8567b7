"""``LowerAttentionPass``: every ``tfgraph.Attention`` becomes what its target chooses.

The pass is the same for every target: it reads the canonical op
(:class:`~tfgraph.passes.canonical.AttentionOp`), hands an :class:`AttentionCase` to the
target's ``lower_attention`` (each target's ``target.py`` under :mod:`tfgraph.exporters` says
which kernel each case becomes, and why), and splices in what the target built on the case's
tape. The target builds with the case's
:class:`~tfgraph.passes.lower.attention_builder.AttentionBuilder`: its standard forms
(ONNX ``Attention``-23, the decomposed standard ops, the causal/window mask) and the pieces a
target's own kernels are made of (``ort``: GroupQueryAttention and MultiHeadAttention, in
``tfgraph.exporters.ort.attention_gqa`` / ``attention_mha``).

Every new node keeps the canonical node's metadata (the PyTorch module name) and records
``tfgraph.lowered_from``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import onnx_ir as ir

from tfgraph.passes.canonical import AttentionOp, is_canonical
from tfgraph.passes.lower.attention_builder import AttentionBuilder, dim_at, same_dim
from tfgraph.passes.rewrite_utils import (
    FUSED_AS_KEY,
    LOWERED_FROM_KEY,
    import_used_domains,
    insert_tape,
    mark_missed,
    replace_value,
)
from tfgraph.passes.target_arg import require_target

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lowered:
    """What a target made of one canonical node: the value replacing its output, the op's
    name for logs, and either why no fused kernel was used (``missed``: reported as a miss) or
    which standard ops the target fuses itself (``fused_as``: reported as fused)."""

    value: ir.Value
    op: str
    missed: str | None = None
    fused_as: str | None = None


@dataclass
class AttentionCase:
    """One canonical attention being lowered: its inputs, its attributes and the builder."""

    node: ir.Node
    q: ir.Value
    k: ir.Value
    v: ir.Value
    bias: ir.Value | None
    spec: AttentionOp
    opset: int
    build: AttentionBuilder
    sink: ir.Value | None = None  # (Hq,) attention sinks, :mod:`.recognize.attention.sink`

    @property
    def head_size(self):
        return dim_at(self.q, 3)

    @property
    def v_head_size(self):
        """V's head size: DeepSeek's MLA has V heads narrower than Q/K's."""
        return dim_at(self.v, 3)

    @property
    def self_attention(self) -> bool:
        """S == T is proved by the shapes (equal ints or the same symbolic dim)."""
        return same_dim(self.q, self.k, 2)

    def cached_kv(self) -> tuple | None:
        """(past_k, new_k, past_v, new_v, present_k, present_v) of a ``cached`` layer whose K
        and V are still the KV-cache pass's ``Concat(past input, new, axis=2)`` graph outputs
        with the new part as long as Q; ``None`` otherwise."""
        if not self.spec.cached:
            return None
        return _cached_kv(self.q, self.k, self.v)


class LowerAttentionPass(ir.passes.InPlacePass):
    """Replace every ``tfgraph.Attention`` by its target's choice (see the module docstring).

    ``target``: a :class:`tfgraph.exporters.target.Target`
    (``tfgraph.exporters.targets.get_target(name)``).
    """

    def __init__(self, target) -> None:
        super().__init__()
        self.target = require_target(target)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        count = 0
        for node in list(model.graph):
            if not is_canonical(node, AttentionOp.OP):
                continue
            lowered = self._lower(model, node, count)
            logger.debug("lowered %s to %s", node.name, lowered)
            count += 1
        if count:
            import_used_domains(model)
        return ir.passes.PassResult(model, modified=bool(count))

    def ensures(self, model: ir.Model) -> None:
        left = [n.name for n in model.graph if is_canonical(n, AttentionOp.OP)]
        if left:
            raise ir.passes.PostconditionError(f"tfgraph.Attention left unlowered: {left}")

    def _lower(self, model: ir.Model, node: ir.Node, index: int) -> str:
        graph = model.graph
        q, k, v, bias, sink = (list(node.inputs) + [None, None])[:5]
        spec = AttentionOp.read(node, head_size=dim_at(q, 3))
        builder = AttentionBuilder(graph, node.name or f"attention{index}", q, k)
        opset = model.opset_imports.get("", 1)
        case = AttentionCase(node, q, k, v, bias, spec, opset, builder, sink)
        result = self.target.lower_attention(case)
        y = result.value
        y.shape, y.type = node.outputs[0].shape, node.outputs[0].type
        insert_tape(graph, node, builder.tape)
        for new in builder.tape.nodes:
            new.metadata_props[LOWERED_FROM_KEY] = AttentionOp.OP
        softmax = next((n for n in builder.tape.nodes if n.op_type == "Softmax"), None)
        if softmax is not None and result.missed is not None:
            mark_missed(softmax, result.missed)
        elif softmax is not None and result.fused_as is not None:
            softmax.metadata_props[FUSED_AS_KEY] = result.fused_as
        replace_value(node.outputs[0], y)
        graph.remove(node, safe=True)
        return result.op


def _cached_kv(q: ir.Value, k: ir.Value, v: ir.Value) -> tuple | None:
    parts = []
    for value in (k, v):
        node = value.producer()
        if node is None or node.op_type != "Concat" or node.attributes.get_int("axis") != 2:
            return None
        if len(node.inputs) != 2 or not node.inputs[0].is_graph_input():
            return None
        if not value.is_graph_output() or len(value.uses()) != 1:
            return None
        if not same_dim(q, node.inputs[1], 2):
            return None
        parts.append((node.inputs[0], node.inputs[1], value))
    (pk, nk, ck), (pv, nv, cv) = parts
    return pk, nk, pv, nv, ck, cv
