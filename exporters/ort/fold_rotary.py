"""``ort`` target: RoPE applied inside ``GroupQueryAttention`` (``do_rotary``).

A traced Llama-style layer rotates Q and K with standard ops before the kernel (per layer
14 nodes: ``q·cos + rotate_half(q)·sin`` twice) and computes the cos/sin tables from the
positions every step. ONNX Runtime's ``GroupQueryAttention`` rotates Q and K itself from
``cos_cache``/``sin_cache`` tables of shape (max positions, d / 2), as onnxruntime-genai's
model builder writes it. This pass recognizes, on each GQA's query and key::

    x ─┬─────────────────────── Mul ─┐
       └ Slice(d/2:) ─ Neg ┐         Add ─ Transpose(0,2,1,3) ─ Reshape(0,0,-1) ─► GQA
         Slice(:d/2) ──────┴ Concat ─ Mul ─┘
    cos = Unsqueeze(Cos(E) [· a], 1),  sin = Unsqueeze(Sin(E) [· a], 1)
    E = Concat(F, F, −1),  F = positions · inv_freq (a constant of d / 2 values)

(the same tables for Q and K, full-width, non-interleaved rotation), and replaces it by
``do_rotary=1`` with ``cos(p · inv_freq) · a`` and ``sin(p · inv_freq) · a`` for
p = 0 … max_positions − 1 as initializers.

The kernel takes the positions from the cache slots (the past length + s; measured on ORT
1.32: with ``position_ids`` given it still uses slots at the first prompt), not from the
graph's position ids. RoPE scores depend only on position differences, so the two agree
wherever positions are the slots shifted by a constant per row: unpadded and left-padded
batches, which is what ``tfgraph.runtime`` feeds (the cache parity checks it, padded rows
included). Not folded (left as they are): head sizes that are not a multiple of the target's
``head_multiple`` (16 for ORT's CPU kernel, measured; set in ``tfgraph/targets/ort.py``),
partial or interleaved rotation, tables not built from a constant frequency vector, and
models without a known ``max_positions``.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from tfgraph.exporters.ort.ops import MS_DOMAIN
from tfgraph.passes.cache.row_lengths import rows_read
from tfgraph.passes.rewrite_utils import (
    add_initializer,
    constant,
    dims_of,
    int_list,
    replace_value,
    same_dims,
)

logger = logging.getLogger(__name__)

HEADS_LAST = [0, 2, 1, 3]


def _producer(value: ir.Value | None, op: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op or node.domain not in ("", "ai.onnx"):
        return None
    return node


def _transposed(value: ir.Value | None) -> ir.Value | None:
    """x when ``value`` is x through Transposes composing to (0, 2, 1, 3) (HF T5 writes K as
    ``permute(0, 2, 3, 1)`` then ``transpose(-1, -2)``)."""
    total = None
    while True:
        node = _producer(value, "Transpose")
        if node is None:
            break
        perm = list(node.attributes.get_ints("perm", []))
        total = perm if total is None else [perm[t] for t in total]
        value = node.inputs[0]
        if total == HEADS_LAST:
            return value
    return None


def bsh_source(value: ir.Value) -> ir.Value | None:
    """x for a kernel input ``Reshape(Transpose(x, 0213), [0, 0, -1])`` (x in (B, H, S, d))."""
    node = _producer(value, "Reshape")
    if node is None or int_list(node.inputs[1]) != [0, 0, -1]:
        return None
    return _transposed(node.inputs[0])


def projection_of(x: ir.Value, width: int) -> ir.Value | None:
    """``y`` when ``x = Transpose(Reshape(y, (B, S, H, d)), 0213)`` and ``y`` is (B, S, H·d)."""
    view = _transposed(x)
    node = _producer(view, "Reshape")
    if node is None:
        return None
    y = node.inputs[0]
    vd, yd = (dims_of(view), dims_of(y)) if view is not None and y is not None else (None, None)
    if vd is None or yd is None or len(vd) != 4 or len(yd) != 3:
        return None
    if yd[2] != width or not all(isinstance(d, int) for d in vd[2:]) or vd[2] * vd[3] != width:
        return None
    if not same_dims([view.shape[0], view.shape[1]], [y.shape[0], y.shape[1]]):
        return None
    return y


def _slice_half(node: ir.Node | None, head: int) -> tuple[ir.Value, str] | None:
    """(data, 'low' | 'high') for a Slice of the last axis at d / 2."""
    if node is None or node.op_type != "Slice":
        return None
    inputs = list(node.inputs) + [None] * 5
    data, starts, ends, axes, steps = inputs[:5]
    if int_list(axes) not in ([-1], [3]) or int_list(steps) not in (None, [1]):
        return None
    start, end = int_list(starts), int_list(ends)
    if start == [0] and end == [head // 2]:
        return data, "low"
    if start == [head // 2] and end is not None and end[0] >= head:
        return data, "high"
    return None


def _split_halves(high: ir.Value, low: ir.Value, head: int) -> ir.Value | None:
    """x when ``low, high = Split(x, 2 halves, axis=-1)`` (``torch.chunk``)."""
    node = _producer(high, "Split")
    if node is None or low.producer() is not node or len(node.outputs) != 2:
        return None
    if list(node.outputs) != [low, high] or node.attributes.get_int("axis", 0) not in (-1, 3):
        return None
    sizes = int_list(node.inputs[1]) if len(node.inputs) > 1 else None
    if sizes not in (None, [head // 2, head // 2]):
        return None
    return node.inputs[0]


def _rotate_half_of(value: ir.Value, head: int) -> ir.Value | None:
    """x for ``Concat(Neg(x[..., d/2:]), x[..., :d/2], axis=-1)`` (Slices or a Split)."""
    node = _producer(value, "Concat")
    if node is None or len(node.inputs) != 2 or node.attributes.get_int("axis") not in (-1, 3):
        return None
    neg = _producer(node.inputs[0], "Neg")
    if neg is None:
        return None
    split = _split_halves(neg.inputs[0], node.inputs[1], head)
    if split is not None:
        return split
    high = _slice_half(neg.inputs[0].producer(), head)
    low = _slice_half(node.inputs[1].producer(), head)
    if high is None or low is None or high[1] != "high" or low[1] != "low":
        return None
    return low[0] if high[0] is low[0] else None


def _table(value: ir.Value, trig: str) -> tuple[ir.Value, float] | None:
    """(E, a) for ``Unsqueeze(Cos(E) [· a], axes=[1])`` or a 2-D ``Cos(E) [· a]``
    (``trig`` "Cos" or "Sin"), read through a per-row gather of the table (rows at their own
    past lengths, :mod:`.row_lengths`: the kernel rotates each row at its own positions)."""
    value = rows_read(value)
    node = _producer(value, "Unsqueeze")
    if node is not None and int_list(node.inputs[1]) == [1]:
        inner = node.inputs[0]  # (B, S, d) → (B, 1, S, d)
    elif value.shape is not None and len(value.shape) == 2:
        inner = value  # (S, d), the same positions for every row
    else:
        return None
    scale = 1.0
    mul = _producer(inner, "Mul")
    if mul is not None:
        for a, b in (mul.inputs, reversed(mul.inputs)):
            c = constant(b)
            if c is not None and c.size == 1:
                inner, scale = a, float(c.reshape(()))
                break
        else:
            return None
    op = _producer(inner, trig)
    return (op.inputs[0], scale) if op is not None else None


def _rotary(value: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """(x, cos, sin) for ``value = x·cos + rotate_half(x)·sin``, x in (B, H, S, d)."""
    add = _producer(value, "Add")
    if add is None:
        return None
    for plain, rotated in (add.inputs, reversed(add.inputs)):
        mul_r, mul_p = _producer(rotated, "Mul"), _producer(plain, "Mul")
        if mul_r is None or mul_p is None:
            continue
        for half, sin in (mul_r.inputs, reversed(mul_r.inputs)):
            for x, cos in (mul_p.inputs, reversed(mul_p.inputs)):
                dims = dims_of(x)
                if dims is None or len(dims) != 4 or not isinstance(dims[3], int):
                    continue
                if _rotate_half_of(half, dims[3]) is x:
                    return x, cos, sin
    return None


def _frequencies(e: ir.Value, half: int) -> np.ndarray | None:
    """inv_freq (d / 2,) for ``E = Concat(F, F, axis=-1)``, ``F = positions · inv_freq``."""
    node = _producer(e, "Concat")
    if node is None or len(node.inputs) != 2 or node.inputs[0] is not node.inputs[1]:
        return None
    if node.attributes.get_int("axis") not in (-1, 2):
        return None
    mul = _producer(node.inputs[0], "Mul")
    if mul is None:
        return None
    for c in (constant(v) for v in mul.inputs):
        if c is not None and c.size == half and c.shape[-1] == half:
            return c.reshape(-1).astype(np.float32)
    return None


class FoldRotaryPass(ir.passes.InPlacePass):
    """See the module docstring. ``max_positions``: the table length (None: no fold)."""

    def __init__(self, max_positions: int | None, head_multiple: int = 1) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.head_multiple = head_multiple  # the target kernel's rotary head-size rule

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self._tables: dict[tuple, list[ir.Value]] = {}
        folded, skipped = 0, []
        for node in list(model.graph):
            if node.domain != MS_DOMAIN:
                continue
            if node.op_type == "GroupQueryAttention":
                reason = self._fold(model.graph, node)
                if isinstance(reason, ir.Node):
                    node, folded = reason, folded + 1
                elif reason:
                    skipped.append(reason)
        if folded:
            logger.info("rotary embedding folded into %d GroupQueryAttention nodes", folded)
        for reason in sorted(set(skipped)):
            logger.info("rotary embedding not folded: %s", reason)
        return ir.passes.PassResult(model, modified=bool(folded))

    def _fold(self, graph: ir.Graph, node: ir.Node) -> ir.Node | str:
        """The new kernel node when folded, else why not ("" when there is no rotation)."""
        if node.attributes.get_int("do_rotary", 0) or len(node.inputs) < 3:
            return ""
        q_in, k_in = node.inputs[0], node.inputs[1]
        if q_in is None or k_in is None:
            return ""
        q_rot, k_rot = bsh_source(q_in), bsh_source(k_in)
        q_parts = _rotary(q_rot) if q_rot is not None else None
        k_parts = _rotary(k_rot) if k_rot is not None else None
        if q_parts is None or k_parts is None:
            return ""
        (xq, cos, sin), (xk, cos_k, sin_k) = q_parts, k_parts
        if cos is not cos_k or sin is not sin_k:
            return "Q and K rotated by different tables"
        head = dims_of(xq)[3]
        if head % self.head_multiple:
            return (
                f"head size {head} is not a multiple of {self.head_multiple} (the kernel's rotary)"
            )
        cos_t, sin_t = _table(cos, "Cos"), _table(sin, "Sin")
        if cos_t is None or sin_t is None or cos_t[0] is not sin_t[0] or cos_t[1] != sin_t[1]:
            return "cos/sin are not Cos/Sin of one angle table"
        inv_freq = _frequencies(cos_t[0], head // 2)
        if inv_freq is None:
            return "the angles are not positions times a constant frequency vector"
        if not self.max_positions:
            return "the model's max_positions is unknown (the tables' length)"
        positions = np.arange(self.max_positions, dtype=np.float32)[:, None]
        angles = positions * inv_freq[None, :]  # float32, as torch computes them
        dtype = (xq.dtype or ir.DataType.FLOAT).numpy()
        key = (inv_freq.tobytes(), cos_t[1], np.dtype(dtype).str)
        if key not in self._tables:  # one pair for all layers (dedup skips big tensors)
            self._tables[key] = [
                add_initializer(
                    graph, f"rotary_{name}", (fn(angles) * np.float32(cos_t[1])).astype(dtype)
                )
                for name, fn in (("cos_cache", np.cos), ("sin_cache", np.sin))
            ]
        tables = self._tables[key]
        inputs = list(node.inputs) + [None] * max(0, 9 - len(node.inputs))
        inputs[0], inputs[1] = _bsh(graph, node, xq), _bsh(graph, node, xk)
        inputs[7], inputs[8] = tables
        attributes = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
        attributes = [a for a in attributes if a.name not in ("do_rotary", "rotary_interleaved")]
        attributes.append(ir.AttrInt64("do_rotary", 1))
        new = ir.Node(
            MS_DOMAIN,
            "GroupQueryAttention",
            inputs,
            attributes=attributes,
            num_outputs=len(node.outputs),
            name=node.name,
            metadata_props=dict(node.metadata_props),
        )
        graph.insert_before(node, new)
        for old, out in zip(node.outputs, new.outputs, strict=True):
            out.shape, out.type, out.name = old.shape, old.type, old.name
            old.name = None
            replace_value(old, out)
        graph.remove(node, safe=True)
        for rotated, x in ((q_rot, xq), (k_rot, xk)):  # shape reads need no rotation
            for user, index in list(rotated.uses()):
                if user.op_type == "Shape":
                    user.replace_input_with(index, x)
        return new


def _bsh(graph: ir.Graph, before: ir.Node, x: ir.Value) -> ir.Value:
    """x (B, H, S, d) as (B, S, H·d): the projection itself when it is one, else a
    Transpose + Reshape."""
    dims = dims_of(x)
    if dims is not None and all(isinstance(d, int) for d in dims[1::2]):
        y = projection_of(x, dims[1] * dims[3])
        if y is not None:
            return y
    t = ir.node("Transpose", [x], {"perm": HEADS_LAST})
    shape = add_initializer(graph, f"{before.name or 'gqa'}_bsh", np.array([0, 0, -1], np.int64))
    r = ir.node("Reshape", [t.outputs[0], shape])
    graph.insert_before(before, t)
    graph.insert_before(before, r)
    return r.outputs[0]
