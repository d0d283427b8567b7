"""Classify each attention bias by evaluating it, then state it in the canonical op.

Masks and position biases are computed by subgraphs that depend only on shapes and on the
``attention_mask`` input (DESIGN-NOTES.md); matching every way a library builds them is
fragile. Instead, for each ``tfgraph.Attention`` with a bias input:

1. Extract the subgraph that computes the bias and run it in ONNX Runtime at two sizes, with an
   all-ones ``attention_mask`` and then with one padded key.
2. Classify what it computes (entries ≤ −1e8 count as masked):
   - masked exactly above the diagonal (and, with a window w, where i − j ≥ w), zero elsewhere:
     ``causal=1`` (``window=w``), and the bias input is dropped: the kernel does it in O(n);
   - the same mask plus finite values: ``causal=1`` and the bias kept, ``bias_kind`` ``alibi``
     (linear in i − j per head), ``relative`` (a function of i − j) or ``additive``;
   - nothing masked: all zero → dropped; else ``alibi`` / ``relative`` / ``additive``, kept;
   - it changes when a key is padded: kept, ``bias_kind="padding"`` (with ``causal=1`` when
     the unpadded pattern is causal);
   - it changes with the token ids (Shaw's ``q·r``, computed from activations): kept,
     ``bias_kind="additive"``; a bias computed from a fused op's output is not evaluated.
3. A classification that differs between the two sizes keeps the bias as ``additive``.
4. A node that is causal already (ONNX ``Attention``'s ``is_causal``) stays causal.

The result is a measured fact, so the report can say exactly what each layer's mask is.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir

from .rewrite_utils import DOMAIN

logger = logging.getLogger(__name__)

MASKED = -1e8
CLASSIFIED_KEY = "tfgraph.bias_classified"
SIZES = (7, 11)  # sequence lengths tried; batch is 2


def _feeds(graph: onnx.GraphProto, size: int, pad: bool, token: int = 0) -> dict:
    dims: dict[str, int] = {}
    feeds = {}
    for inp in graph.input:
        shape = []
        for d in inp.type.tensor_type.shape.dim:
            if d.dim_param:
                if d.dim_param not in dims:
                    dims[d.dim_param] = 2 if d.dim_param == "batch" else size + 2 * len(dims)
                shape.append(dims[d.dim_param])
            else:
                shape.append(d.dim_value)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type)
        if "mask" in inp.name:
            value = np.ones(shape, dtype=dtype)
            if pad and value.ndim >= 2:  # (B, S), or a 4-D mask fed as is (ONNX attn_mask)
                value[(-1,) * value.ndim] = 0
        else:
            value = np.full(shape, token, dtype=dtype)
        feeds[inp.name] = value
    return feeds


def _subgraph(proto: onnx.ModelProto, names: list[str]) -> onnx.ModelProto | None:
    """The nodes computing ``names``; None when one of them is not a standard op."""
    producer = {out: node for node in proto.graph.node for out in node.output}
    keep, stack, seen = set(), list(names), set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in producer:  # a graph input or an initializer
            continue
        node = producer[name]
        if node.domain not in ("", "ai.onnx"):
            return None
        keep.add(id(node))
        stack.extend(i for i in node.input if i)
    graph = onnx.helper.make_graph(
        [n for n in proto.graph.node if id(n) in keep],
        "bias",
        list(proto.graph.input),
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names],
        [t for t in proto.graph.initializer if t.name in seen],
    )
    return onnx.helper.make_model(
        graph, opset_imports=list(proto.opset_import), ir_version=proto.ir_version
    )


def evaluate_biases(model: ir.Model, values: list[ir.Value], size: int, pad: bool, token: int = 0):
    """The bias tensors at one size (batch 2), computed by ONNX Runtime; None for a bias that
    depends on something other than shapes and inputs (e.g. on a fused op's output)."""
    import onnxruntime as ort

    proto = ir.to_proto(model)
    results = []
    for value in values:
        sub = _subgraph(proto, [value.name])
        if sub is None:
            results.append(None)
            continue
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(sub.SerializeToString(), options)
        wanted = {i.name for i in session.get_inputs()}
        feeds = {k: v for k, v in _feeds(sub.graph, size, pad, token).items() if k in wanted}
        results.append(session.run(None, feeds)[0])
    return results


def classify(bias: np.ndarray) -> dict:
    """Attributes implied by one evaluated bias (batch row 0), as described above."""
    e = np.asarray(bias, dtype=np.float64)
    e = e[0] if e.ndim == 4 else e  # (H|1, T|1, S)
    while e.ndim < 3:
        e = e[None]
    t, s = e.shape[-2], e.shape[-1]
    masked = e <= MASKED
    finite = np.where(masked, 0.0, e)
    attrs = {"causal": 0, "window": 0, "keep": True}
    if masked.any():
        if t != s or t == 1:
            return {**attrs, "bias_kind": "additive"}
        i = np.arange(t)[:, None]
        j = np.arange(s)[None, :]
        above = j > i
        window = 0
        band = masked & ~above
        if band.any():
            dist = np.broadcast_to(i - j, masked.shape)[band]
            window = int(dist.min())
        expected = above | ((i - j) >= window if window else False)
        if not np.array_equal(masked, np.broadcast_to(expected, masked.shape)):
            return {**attrs, "bias_kind": "additive"}
        attrs.update(causal=1, window=window)
        visible = ~np.broadcast_to(expected, masked.shape)
    else:
        visible = np.ones_like(masked)
    if not np.any(finite[visible]):
        return {**attrs, "keep": False, "bias_kind": "none"}
    return {**attrs, "bias_kind": _position_kind(finite, visible)}


def _position_kind(finite: np.ndarray, visible: np.ndarray) -> str:
    """``alibi``, ``relative`` or ``additive``, judged up to a constant per row (which softmax
    ignores: BLOOM's ALiBi is m·j, the same as −m·(i − j) after the row's own shift)."""
    t, s = finite.shape[-2:]
    if t != s or t < 3:
        return "additive"
    offset = np.arange(t)[:, None] - np.arange(s)[None, :]  # i − j
    linear = True
    for h in range(finite.shape[0]):
        centered = finite[h] - np.diag(finite[h])[:, None]
        seen = visible[h]
        for d in np.unique(offset[seen]):
            vals = centered[(offset == d) & seen]
            if np.ptp(vals) > 1e-5 * (1 + np.abs(vals).max()):
                return "additive"
        dist, vals = offset[seen], centered[seen]
        slope = vals @ dist / max(float(dist @ dist), 1.0)
        if np.abs(vals - slope * dist).max() > 1e-4 * (1 + np.abs(vals).max()):
            linear = False
    return "alibi" if linear else "relative"


class ClassifyAttentionBiasPass(ir.passes.InPlacePass):
    """Set ``causal``, ``window`` and ``bias_kind`` of each biased ``tfgraph.Attention`` from
    its evaluated bias, and drop the bias input where the kernel attributes say it all."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        nodes = [
            n
            for n in model.graph
            if n.domain == DOMAIN
            and n.op_type == "Attention"
            and len(n.inputs) > 3
            and n.inputs[3] is not None
            and CLASSIFIED_KEY not in n.metadata_props
        ]
        if not nodes:
            return ir.passes.PassResult(model, modified=False)
        values = [n.inputs[3] for n in nodes]
        runs = [evaluate_biases(model, values, size, pad=False) for size in SIZES]
        padded = evaluate_biases(model, values, SIZES[0], pad=True)
        other_tokens = evaluate_biases(model, values, SIZES[0], pad=False, token=1)
        modified = False
        for k, node in enumerate(nodes):
            if any(run[k] is None for run in runs):
                if _split_off_mask(model, node):
                    modified = True
                    continue
                node.metadata_props[CLASSIFIED_KEY] = "not evaluable"
                continue
            found = [classify(run[k]) for run in runs]
            attrs = (
                found[0]
                if all(f == found[0] for f in found)
                else {"causal": 0, "window": 0, "keep": True, "bias_kind": "additive"}
            )
            if not np.array_equal(np.asarray(other_tokens[k]), np.asarray(runs[0][k])):
                # depends on the activations (Shaw's q·r): only its mask structure is a fact
                attrs = {**attrs, "keep": True, "bias_kind": "additive"}
            elif not np.array_equal(np.asarray(padded[k]), np.asarray(runs[0][k])):
                attrs = {**attrs, "keep": True, "bias_kind": "padding"}
            causal = max(attrs["causal"], node.attributes.get_int("causal", 0))  # is_causal stays
            node.attributes["causal"] = ir.AttrInt64("causal", causal)
            node.attributes["window"] = ir.AttrInt64("window", attrs["window"])
            node.attributes["bias_kind"] = ir.AttrString("bias_kind", attrs["bias_kind"])
            if not attrs["keep"]:
                node.resize_inputs(3)
            node.metadata_props[CLASSIFIED_KEY] = attrs["bias_kind"]
            logger.debug("attention %s: %s", node.name, attrs)
            modified = True
        return ir.passes.PassResult(model, modified=modified)


def _split_off_mask(model: ir.Model, node: ir.Node) -> bool:
    """A bias that cannot be evaluated (computed from activations, like Shaw's ``q·r``) but is
    ``Add(term, mask)`` with an evaluable pure causal/window ``mask``: state the mask as
    ``causal``/``window`` and keep only ``term`` as the (``additive``) bias."""
    add = node.inputs[3].producer()
    if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
        return False
    for mask, term in ((add.inputs[1], add.inputs[0]), (add.inputs[0], add.inputs[1])):
        runs = [evaluate_biases(model, [mask], size, pad=False)[0] for size in SIZES]
        if any(r is None or np.ndim(r) < 2 for r in runs):
            continue
        if not all(r.shape[-1] == r.shape[-2] for r in runs):
            continue
        found = [classify(r) for r in runs]
        if all(f == found[0] for f in found) and found[0]["causal"] and not found[0]["keep"]:
            node.attributes["causal"] = ir.AttrInt64("causal", 1)
            node.attributes["window"] = ir.AttrInt64("window", found[0]["window"])
            node.attributes["bias_kind"] = ir.AttrString("bias_kind", "additive")
            node.replace_input_with(3, term)
            node.metadata_props[CLASSIFIED_KEY] = "additive (causal mask split off)"
            logger.debug("attention %s: causal mask split off an activation bias", node.name)
            return True
    return False
