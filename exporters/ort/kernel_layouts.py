"""``ort`` target: no layout round trips around ``GroupQueryAttention`` and
``MultiHeadAttention``, and one shape computation for all layers.

Lowering feeds the kernels (B, S, H·d) inputs made from the canonical (B, H, S, d) ones, and
turns their output back; the traced projections made (B, H, S, d) from (B, S, H·d) in the
first place. So each input is ``Reshape(Transpose(Transpose(Reshape(y))))`` of a projection
``y``, and the output goes through the mirror image; where the shapes prove it (the same
batch and sequence dims, H·d as an int) the kernel reads ``y`` and its output replaces the
final ``Reshape``. ONNX Runtime cancels the Transposes itself but runs the Reshapes.

Single-axis ``Shape`` reads (the kernels' sequence lengths, per layer) of a value whose dim
is a named symbol read that axis of the first graph input carrying the same symbol, so the
layers' length subgraphs are identical and common-subexpression elimination keeps one.
"""

from __future__ import annotations

import onnx_ir as ir

from tfgraph.exporters.ort.fold_rotary import HEADS_LAST, bsh_source, projection_of
from tfgraph.exporters.ort.ops import MS_DOMAIN
from tfgraph.passes.cache.split_encoder import cross_kv_entries
from tfgraph.passes.rewrite_utils import dims_of, int_list, replace_value, same_dims


class KernelLayoutsPass(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        count = 0
        keep = {name for name, _, _ in cross_kv_entries(model)}  # the encoder's outputs
        for node in list(model.graph):
            if node.domain == MS_DOMAIN and node.op_type in (
                "GroupQueryAttention",
                "MultiHeadAttention",
            ):
                count += _shortcut_layouts(node, keep)
        count += _shape_reads_from_inputs(model.graph, keep)
        return ir.passes.PassResult(model, modified=bool(count))


def _input_dependencies(graph: ir.Graph, cut: set[str]) -> dict[ir.Value, int]:
    """Each value's graph inputs as a bit set (bit i: ``graph.inputs[i]``); values named in
    ``cut`` (the cross K/V, inputs of the decoder graph once the encoder is split off) depend
    on none."""
    deps: dict[ir.Value, int] = {v: 1 << i for i, v in enumerate(graph.inputs)}
    for node in graph:
        mask = 0
        for value in node.inputs:
            if value is not None:
                mask |= deps.get(value, 0)
        for out in node.outputs:
            deps[out] = 0 if out.name in cut else mask
    return deps


def _shape_reads_from_inputs(graph: ir.Graph, cut: set[str]) -> int:
    """Only inputs the read value already depends on are used: an encoder-decoder's decoder
    part must not start reading the encoder's inputs (its step graph has none)."""
    named: dict[str, list[tuple[int, int]]] = {}
    for i, value in enumerate(graph.inputs):
        for axis, dim in enumerate(value.shape or []):
            if isinstance(dim, ir.SymbolicDim) and dim.value:
                named.setdefault(dim.value, []).append((i, axis))
    deps = _input_dependencies(graph, cut)
    count = 0
    for node in graph:
        if node.op_type != "Shape" or node.domain not in ("", "ai.onnx"):
            continue
        source = node.inputs[0]
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", None) if "end" in node.attributes else None
        if source is None or source.shape is None or end != start + 1 or start < 0:
            continue
        if start >= len(source.shape) or source.is_graph_input():
            continue
        dim = source.shape[start]
        if not isinstance(dim, ir.SymbolicDim) or dim.value not in named:
            continue
        reachable = [(i, a) for i, a in named[dim.value] if deps.get(source, 0) >> i & 1]
        if not reachable:
            continue
        index, axis = reachable[0]
        node.replace_input_with(0, graph.inputs[index])
        node.attributes["start"] = ir.AttrInt64("start", axis)
        node.attributes["end"] = ir.AttrInt64("end", axis + 1)
        count += 1
    return count


def _shortcut_layouts(node: ir.Node, keep: set[str]) -> int:
    """Kernel inputs and outputs that round-trip through (B, H, S, d) read the projection."""
    count = 0
    for index in range(min(3, len(node.inputs))):
        value = node.inputs[index]
        x = bsh_source(value) if value is not None else None
        if x is not None and x.name in keep:
            continue  # a cross-attention K/V the encoder graph will output
        dims = dims_of(x) if x is not None else None
        if dims is None or len(dims) != 4 or not all(isinstance(d, int) for d in dims[1::2]):
            continue
        y = projection_of(x, dims[1] * dims[3])
        if y is not None:
            node.replace_input_with(index, y)
            count += 1
    count += _cross_kv_heads_first(node, keep)
    count += _shortcut_output(node)
    return count


def _cross_kv_heads_first(node: ir.Node, keep: set[str]) -> int:
    """A MultiHeadAttention over the cached cross K/V (B, H, S_enc, d) reads them as they are:
    the kernel takes 4-D key/value in that layout, so a decode step does not transpose the
    whole encoder output per layer (measured: 4 × ~45 µs of a ~1.4 ms T5 step)."""
    if node.op_type != "MultiHeadAttention" or len(node.inputs) < 3:
        return 0
    heads = node.attributes.get_int("num_heads", 0)
    sources = []
    for value in node.inputs[1:3]:
        x = bsh_source(value) if value is not None else None
        dims = dims_of(x) if x is not None else None
        if x is None or x.name not in keep or dims is None or len(dims) != 4 or dims[1] != heads:
            return 0
        sources.append(x)
    if node.inputs[1:3] == tuple(sources):  # read as they are already (an earlier run)
        return 0
    node.replace_input_with(1, sources[0])
    node.replace_input_with(2, sources[1])
    return 1


def _is_heads_last(node: ir.Node) -> bool:
    return node.op_type == "Transpose" and list(node.attributes.get_ints("perm", [])) == (
        HEADS_LAST
    )


def _users(value: ir.Value, accept) -> list[ir.Node]:
    return [user for user, _ in list(value.uses()) if accept(user)]


def _splits_heads(node: ir.Node) -> bool:
    """``Reshape(y, (0, 0, H, -1))``."""
    heads = int_list(node.inputs[1]) if node.op_type == "Reshape" else None
    return heads is not None and len(heads) == 4 and heads[:2] == [0, 0] and heads[3] == -1


def _round_trips(y: ir.Value):
    """(y4, merge) for each ``Reshape(y, (0, 0, H, -1)) → Transpose → Transpose → Reshape``:
    y4 the first Transpose's output, merge the final Reshape."""
    for split in _users(y, _splits_heads):
        for first in _users(split.outputs[0], _is_heads_last):
            for second in _users(first.outputs[0], _is_heads_last):
                for merge in _users(second.outputs[0], lambda n: n.op_type == "Reshape"):
                    yield first.outputs[0], merge


def _shortcut_output(node: ir.Node) -> int:
    """The round trip of the kernel's output y back to (B, S, H·d) is y: the first
    Transpose's output is the attention's (B, H, S, d), whose shape says (B, S, H·d)."""
    y, count = node.outputs[0], 0
    for y4, merge in list(_round_trips(y)):
        dims, out = dims_of(y4), merge.outputs[0]
        od = dims_of(out)
        if dims is None or len(dims) != 4 or not all(isinstance(d, int) for d in dims[1::2]):
            continue
        if od is None or len(od) != 3 or od[2] != dims[1] * dims[3] or out.is_graph_output():
            continue
        if not same_dims([out.shape[0], out.shape[1]], [y4.shape[0], y4.shape[2]]):
            continue
        if not out.uses() and y.shape == out.shape and y.type == out.type:
            continue  # rewired by an earlier run: nothing would change
        y.shape, y.type = ir.Shape(out.shape), out.type  # the kernel's output had neither
        replace_value(out, y)
        count += 1
    return count
