"""Fold the constant factors multiplying a ``tfgraph.RMSNorm`` into its γ.

An L2-normalize norm (:mod:`.normalize_rules`) leaves ``Mul(RMSNorm(x), 1/√d)``, and the model
multiplies by its own constants after it: ``F.normalize(x, dim=-1) * √d * γ`` becomes
``((RMSNorm(x) · 1/√d) · √d) · γ``. A hand-written RMSNorm times a scalar
(``x * rsqrt(mean(x²) + ε) * scale * γ``) leaves the same chain. :mod:`.norm_rules`' scale rule
absorbs one per-feature ``Mul`` only; this folds the whole chain::

    RMSNorm(x[, γ₀]) ─► Mul(·, c₁) ─► Mul(·, c₂) … ─► y   ⇒   RMSNorm(x, γ′) ─► y,
    γ′ = γ₀ · c₁ · c₂ …   (one value per feature, shape (d,))

Each ``cᵢ`` is a constant (initializer or ``Constant``) that is a scalar or one value per
feature (all dims but the last 1, the last 1 or d, rank at most y's), and each link is the
only use of the value before it. γ′ is a lazy initializer (:func:`~tfgraph.passes.lazy_weights.
derived`): a checkpoint bound lazily is read only when the artifact is written. It is computed
in float64 and rounded once to x's dtype, so it may differ from the eager product by one
rounding of the factors (about 1e-7 relative in fp32).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tfgraph.passes.canonical import DOMAIN, RMSNormOp, is_canonical
from tfgraph.passes.lazy_weights import DERIVED, derived, register, tensor_of
from tfgraph.passes.recognize.normalize_rules import last_dim
from tfgraph.passes.rewrite_utils import replace_value


def _per_feature(tensor, rank: int, d: int) -> bool:
    dims = list(tensor.shape)
    if len(dims) > rank or any(not isinstance(n, int) for n in dims):
        return False
    return all(n == 1 for n in dims[:-1]) and (not dims or dims[-1] in (1, d))


def _constant_chain(norm: ir.Node, rank: int, d: int) -> tuple[list[ir.Node], list]:
    """The ``Mul`` nodes by constants that follow ``norm`` one after another, and their
    constants."""
    muls, factors = [], []
    value = norm.outputs[0]
    while not value.is_graph_output() and len(value.uses()) == 1:
        use = next(iter(value.uses()))
        user = use.node
        if user.op_type != "Mul" or user.domain not in ("", "ai.onnx") or len(user.inputs) != 2:
            break
        other = user.inputs[1 - use.idx]
        tensor = tensor_of(other)
        if other is value or tensor is None or not _per_feature(tensor, rank, d):
            break
        muls.append(user)
        factors.append(tensor)
        value = user.outputs[0]
    return muls, factors


def _product(d: int, dtype: np.dtype):
    def compute(*arrays: np.ndarray) -> np.ndarray:
        gamma = np.ones(d, dtype=np.float64)
        for a in arrays:
            gamma = gamma * np.asarray(a, dtype=np.float64).reshape(-1)
        return gamma.astype(dtype)

    return compute


def _fold(graph: ir.Graph, norm: ir.Node) -> bool:
    x = norm.inputs[0]
    d = last_dim(x)
    if d is None or x.dtype is None:
        return False
    muls, factors = _constant_chain(norm, len(x.shape), d)
    if not muls:
        return False
    gamma = norm.inputs[1] if len(norm.inputs) > 1 else None
    if gamma is not None:
        tensor = tensor_of(gamma)
        if tensor is None or not _per_feature(tensor, len(x.shape), d):
            return False
        factors.insert(0, tensor)
    name = f"{norm.name or 'rms_norm'}_scale"
    lazy = derived(_product(d, x.dtype.numpy()), factors, x.dtype, [d], name)
    lazy.meta[DERIVED] = ("product", None, tuple(factors))
    scale = register(graph, name, lazy)
    epsilon = RMSNormOp.read(norm).epsilon
    new = ir.node(RMSNormOp.OP, [x, scale], {"epsilon": epsilon}, domain=DOMAIN)
    out, y = muls[-1].outputs[0], new.outputs[0]
    y.shape, y.type = out.shape, out.type
    new.metadata_props.update(norm.metadata_props)
    graph.insert_before(norm, new)
    replace_value(out, y)
    graph.remove([norm, *muls], safe=True)
    return True


def fold_norm_scales(model: ir.Model) -> int:
    """Fold every chain of the module docstring; the number of norms changed."""
    graph = model.graph
    return sum(_fold(graph, n) for n in list(graph) if is_canonical(n, RMSNormOp.OP))
