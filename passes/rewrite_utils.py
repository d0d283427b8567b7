"""Shared machinery for recognition and lowering passes built on onnxscript's rewriter.

- :data:`DOMAIN`: the ``tfgraph`` domain of our canonical ops (attributes state semantics).
- :func:`apply_rules`: apply a rule set, returning how many rewrites happened. The rewriter tags
  each new node with the rule that made it (``pkg.onnxscript.rewriter.rule_name``) and copies
  the matched nodes' metadata, so fused nodes keep their PyTorch module name.
- :func:`diagnose`: why did no rule fuse a candidate? Tries every rule at every node
  downstream of the candidate and returns the reason of the deepest partial match (a failed
  ``check`` beats a structural mismatch), so a miss is reported with a cause, never silently.
- :func:`mark_missed`: record that reason on the candidate node for the report.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchingTracer, RewriteRuleSet
from onnxscript.rewriter import pattern as _pattern

from tfgraph.passes.canonical import DOMAIN  # noqa: F401  (re-exported: the passes' domain)

logger = logging.getLogger(__name__)

MISS_REASON_KEY = "tfgraph.miss_reason"
EXCLUDED_KEY = "tfgraph.excluded"  # "true": left unfused on purpose (not an exact match)
# On a node that stays standard ops on purpose because the target fuses it itself (TensorRT's
# MatMul-Softmax-MatMul): what the target makes of it. The report counts it as fused.
FUSED_AS_KEY = "tfgraph.fused_as"
# On every node a lowering pass made: the canonical op it came from ("Attention", "LayerNorm").
LOWERED_FROM_KEY = "tfgraph.lowered_from"


def apply_rules(model: ir.Model, rules: RewriteRuleSet) -> int:
    """Apply ``rules`` to the model's main graph and functions; the number of rewrites."""
    return rules.apply_to_model(model)


def downstream(node: ir.Node, depth: int) -> list[ir.Node]:
    """Nodes reachable from ``node`` through at most ``depth`` uses, nearest first."""
    seen, frontier, order = {id(node)}, [node], [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for out in n.outputs:
                for use in out.uses():
                    user = use.node
                    if id(user) not in seen:
                        seen.add(id(user))
                        nxt.append(user)
        order.extend(nxt)
        frontier = nxt
    return order


def diagnose(
    model: ir.Model, rules: Iterable[_pattern.RewriteRule], candidate: ir.Node, depth: int = 10
) -> str:
    """The first reason the rules failed on ``candidate``'s subgraph, from the best attempt
    (the matcher's own texts said in words: :func:`readable_reason`)."""
    tracer = MatchingTracer()
    graph = candidate.graph or model.graph
    for node in downstream(candidate, depth):
        for rule in rules:
            rule.match(
                model, graph, node, tracer=tracer, check_nodes_are_removable=rule.remove_nodes
            )
    best = None
    for matches in tracer.best_matches_map.values():
        for info in matches:
            if best is None or info.score() > best.score():
                best = info
    if best is None or not best.match_result.reason:
        return "no rule matched its subgraph"
    return readable_reason(str(best.match_result.reason))


# onnxscript's matcher texts (its ``fail`` calls) → what a user reads in the fusion report
_MATCHER_TEXTS = (
    (r"OpType mismatch: expected (\S+), got (\S+)\.", "{1} where the rules expect {0}"),
    (r"Domain mismatch: expected (\S*), got (\S*)\.", "domain '{1}' where the rules expect '{0}'"),
    (
        r"Attribute (\w+) (?:mismatch|not found|not expected)",
        "an attribute {0} the rules do not take",
    ),
    (r"Value (\S+) is not a constant", "{0} computed where the rules expect a constant"),
    (r"alue mismatch: expected (.+), got (.+)\.$", "the constant {1} where the rules expect {0}"),
    (r"Value \S+ (?:is not a scalar|has shape)", "a constant of a shape the rules do not take"),
    (r"None of the alternatives matched", "none of the variants the rules know"),
    (r"Matched nodes have other uses", "an intermediate result that has other uses"),
    (r"Number of inputs", "an op with more inputs than the rules take"),
    (r"crossing graph boundaries", "a subgraph crossing into a nested graph (If, Loop)"),
    (r"Mismatch: |output index mismatch|Same pattern node|to be None", "another structure"),
)


def readable_reason(reason: str) -> str:
    """A miss reason a user can act on: our rules' ``check`` reasons as they are; onnxscript's
    matcher texts ("OpType mismatch: expected Add, got Reshape.") said in words."""
    for text, say in _MATCHER_TEXTS:
        found = re.search(text, reason)
        if found:
            return "not a form the rules know: " + say.format(*found.groups())
    return reason


def weight_bytes(model: ir.Model) -> int:
    """Bytes of all initializers of the main graph."""
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value)


def insert_tape(graph: ir.Graph, before: ir.Node, tape: ir.tape.Tape) -> None:
    """Insert a tape's nodes (and initializers) in front of ``before``, carrying its metadata
    (the PyTorch module name) onto every new node, so reports keep naming the layer."""
    for initializer in tape.initializers:
        graph.register_initializer(initializer)
    graph.insert_before(before, tape.nodes)
    for node in tape.nodes:
        for key, value in before.metadata_props.items():
            node.metadata_props.setdefault(key, value)


def replace_value(old: ir.Value, new: ir.Value) -> None:
    """Point every use of ``old`` at ``new``; a graph output keeps its name."""
    name = old.name if old.is_graph_output() else None
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    if name is not None:
        old.name = f"{name}__replaced"
        new.name = name


def import_used_domains(model: ir.Model) -> None:
    """Import (at version 1) every custom domain a lowering put into the main graph."""
    for node in model.graph:
        if node.domain not in ("", "ai.onnx"):
            model.opset_imports.setdefault(node.domain, 1)


def mark_missed(node: ir.Node, reason: str, *, excluded: bool = False) -> None:
    node.metadata_props[MISS_REASON_KEY] = reason
    if excluded:
        node.metadata_props[EXCLUDED_KEY] = "true"


def constant(value: ir.Value | None) -> np.ndarray | None:
    """The value of an initializer or a ``Constant`` node's output, else ``None``."""
    if value is None:
        return None
    const = ir.convenience.get_const_tensor(value)
    return None if const is None else np.asarray(const.numpy())


def scalar(value: ir.Value | None) -> float | None:
    """A constant scalar's value (initializer, ``Constant`` node, or 1-element tensor)."""
    array = constant(value)
    return float(array.reshape(-1)[0]) if array is not None and array.size == 1 else None


def dims_of(value: ir.Value) -> list | None:
    """A value's dims as ints and symbol names (None for an unknown dim), or None."""
    if value.shape is None:
        return None
    return [d.value if isinstance(d, ir.SymbolicDim) else d for d in value.shape]


def int_list(value: ir.Value | None) -> list[int] | None:
    """A constant integer tensor as a list (``axes`` inputs)."""
    array = constant(value)
    return None if array is None else [int(v) for v in array.reshape(-1)]


_DIM_NAME = re.compile(r"[A-Za-z_]\w*")


def same_dims(a, b) -> bool:
    """Two shapes' dims are equal: the same int or name, or symbolic expressions that are
    equal for every positive integer value of their symbols (torch.export names a ``view(...,
    -1)`` dim ``((sequence**2)//sequence)``, which is ``sequence``)."""
    a, b = list(a), list(b)
    return len(a) == len(b) and all(_same_dim(x, y) for x, y in zip(a, b, strict=True))


def _same_dim(x, y) -> bool:
    if x == y:
        return True
    x, y = (d.value if isinstance(d, ir.SymbolicDim) else d for d in (x, y))
    if x is None or y is None or (isinstance(x, int) and isinstance(y, int)):
        return False
    import sympy

    text = f"({x}) - ({y})"
    symbols = {n: sympy.Symbol(n, integer=True, positive=True) for n in _DIM_NAME.findall(text)}
    try:
        return sympy.simplify(sympy.sympify(text, locals=symbols)) == 0
    except (sympy.SympifyError, TypeError, ValueError, SyntaxError):
        return False


def add_initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """A new initializer holding ``array``, named ``name`` (suffixed until unique)."""
    unique, i = name, 0
    while unique in graph.initializers:
        i += 1
        unique = f"{name}_{i}"
    value = ir.Value(name=unique, const_value=ir.tensor(array), shape=ir.Shape(array.shape))
    value.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
    graph.register_initializer(value)
    return value
