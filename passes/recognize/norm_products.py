"""Put the products of a hand-written norm in the order the norm rules match.

Multiplication commutes, so people write RMSNorm as ``x * rsqrt(ms)`` then ``* w``, but just
as well ``w * x * rsqrt(ms)``, ``rsqrt(ms) * w * x``, ``x * (w * rsqrt(ms))`` or
``w * x / sqrt(ms)`` (LayerNorm the same with ``x − mean``). The core rules
(:mod:`.norm_rules`) match ``Mul(a, Reciprocal(Sqrt(·)))`` or ``Div(a, Sqrt(·))``, then absorb
a ``Mul(·, γ)``. This rewrite, run first, turns every arrangement into that one:

1. A tree of ``Mul`` nodes (each inner one used only inside the tree) whose factors are one
   normalizer ``r = Reciprocal(Sqrt(v))``, at most one per-feature constant ``w`` and one
   other value ``a`` becomes ``Mul(Mul(a, r), w)`` (``Mul(a, r)`` without ``w``)::

       w ─┐                 a ─┐
          Mul ─┐               Mul ─┐
       a ─┘    Mul ─► y  ⇒  r ─┘    Mul ─► y
       r ──────┘            w ──────┘

2. ``Div(tree, Sqrt(v))`` whose tree's factors are ``w`` and ``a`` becomes
   ``Mul(Div(a, Sqrt(v)), w)``.

Trees already in that order are left alone; so is anything with other factors (nothing else
is reassociated). ``v`` must come from a ``ReduceMean`` (the mean square or the variance).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tfgraph.passes.rewrite_utils import constant


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        return None
    return node


def _is_root_of_mean(value: ir.Value) -> bool:
    """``Sqrt(v)`` with ``v`` a ReduceMean, or ReduceMean + ε."""
    sqrt = _producer(value, "Sqrt")
    if sqrt is None:
        return False
    v = sqrt.inputs[0]
    add = _producer(v, "Add")
    if add is not None:
        return any(_producer(i, "ReduceMean") is not None for i in add.inputs)
    return _producer(v, "ReduceMean") is not None


def _is_normalizer(value: ir.Value) -> bool:
    reciprocal = _producer(value, "Reciprocal")
    return reciprocal is not None and _is_root_of_mean(reciprocal.inputs[0])


def _is_scale(value: ir.Value) -> bool:
    """A per-feature constant: 1-D, or all dims but the last of size 1."""
    array = constant(value)
    return array is not None and array.ndim >= 1 and int(np.prod(array.shape[:-1])) == 1


def _factors(value: ir.Value, root: ir.Node) -> tuple[list[ir.Value], list[ir.Node]]:
    """The factors of the Mul tree rooted at ``value`` and the tree's nodes."""
    node = _producer(value, "Mul")
    if node is None or (node is not root and (len(value.uses()) != 1 or value.is_graph_output())):
        return [value], []
    factors, nodes = [], [node]
    for i in node.inputs:
        f, n = _factors(i, root)
        factors += f
        nodes += n
    return factors, nodes


def _classify(factors: list[ir.Value]) -> tuple | None:
    """(a, r, w) with w possibly None, when the factors are exactly that; else None."""
    normalizers = [f for f in factors if _is_normalizer(f)]
    scales = [f for f in factors if f not in normalizers and _is_scale(f)]
    others = [f for f in factors if f not in normalizers and f not in scales]
    if len(normalizers) > 1 or len(scales) > 1 or len(others) != 1:
        return None
    return others[0], (normalizers or [None])[0], (scales or [None])[0]


def _is_canonical(root: ir.Node, a, r, w) -> bool:
    if w is None:
        return list(root.inputs) == [a, r]
    inner = next((i for i in root.inputs if i is not w), None)
    node = _producer(inner, "Mul") if inner is not None else None
    return node is not None and list(node.inputs) == [a, r]


def reorder_norm_products(model: ir.Model) -> int:
    """Rewrite every arrangement in the module docstring; the number of rewrites."""
    graph = model.graph
    count = 0
    for root in list(graph):
        if root.graph is None or root.domain not in ("", "ai.onnx"):
            continue
        out = root.outputs[0]
        if root.op_type == "Mul":
            if any(u.node.op_type == "Mul" and len(out.uses()) == 1 for u in out.uses()):
                continue  # not the root of its tree
            factors, nodes = _factors(out, root)
            parts = _classify(factors)
            if parts is None or parts[1] is None or _is_canonical(root, *parts):
                continue
            a, r, w = parts
            inner = ir.node("Mul", [a, r])
        elif root.op_type == "Div" and _is_root_of_mean(root.inputs[1]):
            factors, nodes = _factors(root.inputs[0], None)
            parts = _classify(factors)
            if not nodes or parts is None or parts[1] is not None or parts[2] is None:
                continue
            a, _, w = parts
            inner = ir.node("Div", [a, root.inputs[1]])
            nodes = [root, *nodes]
        else:
            continue
        new = [inner] + ([ir.node("Mul", [inner.outputs[0], w])] if w is not None else [])
        result = new[-1].outputs[0]
        result.shape, result.type = out.shape, out.type
        for n in new:
            n.metadata_props.update(root.metadata_props)
        graph.insert_before(root, new)
        out.replace_all_uses_with(result, replace_graph_outputs=True)
        graph.remove(nodes, safe=True)
        count += 1
    return count
