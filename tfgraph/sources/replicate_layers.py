"""Trace the first layers of a deep model and copy the rest in the graph.

torch.export's cost grows with every layer it traces (about 1.5 s per decoder layer of a
1.1B Llama here, most of the export's wall time), while a stack of identical layers gives the
same subgraph for each one. So a model whose layers after the first are identical modules
(same class, same parameter names and shapes, same settings but their index) is traced with
only its first :data:`TRACED` layers; the graph of the last traced layer is then copied once
per remaining layer, wired as the traced layers are wired to each other, with that layer's own
parameters (bound lazily or live, as the traced ones are).

It is a shortcut, so it proves itself before it is taken: the last two traced layers must give
the same subgraph node for node (operators, attributes, wiring, constants), and the module
check must find every later layer equal to the template. Anything else — a layer that differs,
a value passed to a layer from further back than the one before, a subgraph attribute, a trace
of the shortened model that fails — traces every layer, as before, and the log says why. The
exported graph is the one a full trace gives (tested on the zoo and the Hugging Face tests:
same nodes, attributes, initializers and wiring), and parity against the eager model, which
always runs every layer, checks the result as it checks any export.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from torch import nn

logger = logging.getLogger(__name__)

TRACED = 4  # layers traced: the template is the last, the one before it proves the wiring
MIN_LAYERS = TRACED + 2  # fewer than this: tracing them all costs little
SCOPES = "pkg.torch.onnx.name_scopes"
OFF = "TFGRAPH_TRACE_EVERY_LAYER"  # set to 1 to trace every layer (a debugging switch)


@dataclass
class Plan:
    """A layer stack to shorten: the ModuleList at ``path`` of the traced module."""

    path: str
    layers: nn.ModuleList

    @property
    def count(self) -> int:
        return len(self.layers)


def plan(module: nn.Module) -> Plan | None:
    """The layer stack of ``module`` to trace shortened, or ``None`` (with the reason logged at
    debug level): the ModuleList holding the most parameters, if its layers after the first
    are all equal modules and there are at least :data:`MIN_LAYERS`."""
    if os.environ.get(OFF) == "1":
        return None
    best, size = None, 0
    for path, child in module.named_modules():
        if not isinstance(child, nn.ModuleList) or len(child) < MIN_LAYERS:
            continue
        params = sum(p.numel() for p in child.parameters())
        if params > size:
            best, size = (path, child), params
    if best is None:
        return None
    path, layers = best
    found = [signature(layer) for layer in layers]
    # an integer setting equal to each layer's own position (``layer_idx``) is its index
    index = {k for k, v in found[0].items() if all(f.get(k) == i for i, f in enumerate(found))}
    template = {k: v for k, v in found[TRACED - 1].items() if k not in index}
    for i in range(1, len(layers)):
        if {k: v for k, v in found[i].items() if k not in index} != template:
            logger.debug("tracing every layer: %s.%d differs from %s.%d", path, i, path, TRACED - 1)
            return None
    return Plan(path, layers)


def signature(layer: nn.Module) -> dict:
    """What must be equal for two layers to trace alike, by (submodule, what): each
    submodule's class, its parameters' and buffers' names, shapes and dtypes, and its plain
    settings (numbers, strings, flags, tuples of them)."""
    parts: dict = {}
    for name, sub in layer.named_modules():
        parts[(name, "class")] = type(sub).__qualname__
        parts[(name, "tensors")] = tuple(
            (n, tuple(t.shape), str(t.dtype))
            for n, t in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]
        )
        for key, value in vars(sub).items():
            if not key.startswith("_") and key != "training":
                parts[(name, key)] = _plain(value)
    return parts


def _plain(value):
    if isinstance(value, (str, float, bool, type(None))):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _plain(v)) for k, v in value.items()))
    return type(value).__qualname__  # configs, callables: by kind (their values reach the graph)


@contextlib.contextmanager
def shortened(module: nn.Module, found: Plan):
    """``module`` with its layer stack cut to the first :data:`TRACED` layers, restored after."""
    owner_path, _, attr = found.path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    setattr(owner, attr, nn.ModuleList(list(found.layers)[:TRACED]))
    try:
        yield
    finally:
        setattr(owner, attr, found.layers)


class NotReplicable(Exception):
    """The traced layers do not prove that the rest can be copied (the message says why)."""


def replicate(model: ir.Model, found: Plan) -> int:
    """Copy the last traced layer of ``model`` (traced :func:`shortened`) for every remaining
    layer of ``found``; returns how many layers were added. Parameters are named by their
    module path, as torch.export names them. Raises :class:`NotReplicable` when the traced layers do
    not prove it (``model`` is then to be dropped: it may be half copied)."""
    graph = model.graph
    layers = _layer_nodes(graph, found.path)
    if sorted(layers) != list(range(TRACED)):
        raise NotReplicable(f"the graph has nodes of layers {sorted(layers)}, not 0..{TRACED - 1}")
    prev, template = layers[TRACED - 2], layers[TRACED - 1]
    carry = _wiring(prev, template, layers[TRACED - 3], found.path, TRACED - 2)
    outside = {n for nodes in layers.values() for n in nodes}
    for i in range(TRACED - 1):  # only the last layer may feed what follows the stack
        for node in layers[i]:
            if node.op_type == "Constant":  # the exporter shares equal constants
                continue
            for v in node.outputs:
                if v.is_graph_output() or any(u.node not in outside for u in v.uses()):
                    raise NotReplicable(f"a value of layer {i} is used after the layers")
    last = template[-1]
    consumers = [
        (use.node, use.idx, v)
        for node in template
        for v in node.outputs
        for use in v.uses()
        if use.node not in outside
    ]
    graph_outputs = [(i, v) for i, v in enumerate(graph.outputs) if v.producer() in template]
    previous = template
    for j in range(TRACED, found.count):
        clone = _clone(graph, template, carry, previous, found, j)
        graph.insert_after(last, clone)
        last, previous = clone[-1], clone
    index = {id(n): k for k, n in enumerate(template)}
    for node, idx, value in consumers:
        m = index[id(value.producer())]
        node.replace_input_with(idx, previous[m].outputs[value.index()])
    for i, value in graph_outputs:
        graph.outputs[i] = _renamed_output(
            value, previous[index[id(value.producer())]].outputs[value.index()]
        )
    added = found.count - TRACED
    logger.info("traced %d of %d layers of %s; copied layer %d for the other %d",
                TRACED, found.count, found.path, TRACED - 1, added)  # fmt: skip
    return added


def _renamed_output(template: ir.Value, last: ir.Value) -> ir.Value:
    """``last`` (the last copied layer's value) under the graph output name ``template`` had
    (a model whose output is its last layer's, BERT's ``last_hidden_state``: the copy was
    named ``…_l{j}``, so the artifact's output was not the source's); the template's value,
    now inside the stack, takes the copy's suffixed name in exchange."""
    name = template.name
    template.name = f"{name}_l{TRACED - 1}"
    last.name = name
    return last


def _layer_nodes(graph: ir.Graph, path: str) -> dict[int, list[ir.Node]]:
    """Nodes by the layer of ``path`` whose scope they are in, in graph order."""
    pattern = re.compile(rf"'{re.escape(path)}\.(\d+)'")
    layers: dict[int, list[ir.Node]] = {}
    for node in graph:
        found = pattern.search(node.metadata_props.get(SCOPES, ""))
        if found:
            layers.setdefault(int(found.group(1)), []).append(node)
    return layers


def _wiring(a: list, b: list, before: list, names: str, ia: int) -> dict[ir.Value, tuple]:
    """Check that layer ``b`` (index ``ia + 1``) is layer ``a`` node for node, and wired to
    ``a`` as ``a`` is to ``before``; the inputs of ``b`` that ``a`` produces → (node, output)."""
    if len(a) != len(b):
        raise NotReplicable(f"layers {ia} and {ia + 1} have {len(a)} and {len(b)} nodes")
    pos_a = {id(n): k for k, n in enumerate(a)}
    pos_b = {id(n): k for k, n in enumerate(b)}
    pos_before = {id(n): k for k, n in enumerate(before)}
    carried: dict[ir.Value, tuple] = {}
    for k, (na, nb) in enumerate(zip(a, b, strict=True)):
        what = f"node {k} of layers {ia} and {ia + 1} ({na.op_type})"
        if (na.domain, na.op_type, na.overload, len(na.inputs), len(na.outputs)) != (
            nb.domain, nb.op_type, nb.overload, len(nb.inputs), len(nb.outputs)
        ):  # fmt: skip
            raise NotReplicable(f"{what}: {nb.op_type} differs")
        _same_attributes(na, nb, what)
        for va, vb in zip(na.inputs, nb.inputs, strict=True):
            if va is None or vb is None:
                if va is not vb:
                    raise NotReplicable(f"{what}: an optional input differs")
                continue
            ka, kb = _producer_key(va, pos_a), _producer_key(vb, pos_b)
            if ka is not None or kb is not None:  # made inside the layer
                if ka != kb:
                    raise NotReplicable(f"{what}: wired differently inside the layer")
                continue
            kb_prev = _producer_key(vb, pos_a)
            if kb_prev is not None:  # b takes it from a: a must take the same from before
                if _producer_key(va, pos_before) != kb_prev:
                    raise NotReplicable(f"{what}: takes a value from further back")
                carried[vb] = kb_prev
                continue
            _same_outside(va, vb, names, ia, what)
    return carried


def _producer_key(value: ir.Value, positions: dict) -> tuple | None:
    producer = value.producer()
    if producer is None or id(producer) not in positions:
        return None
    return positions[id(producer)], value.index()


def _same_attributes(na: ir.Node, nb: ir.Node, what: str) -> None:
    if set(na.attributes) != set(nb.attributes):
        raise NotReplicable(f"{what}: attributes differ")
    for key, attr in na.attributes.items():
        other = nb.attributes[key]
        if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            raise NotReplicable(f"{what}: has a subgraph")
        if attr.type == ir.AttributeType.TENSOR:
            equal = _equal_tensors(attr.value, other.value)
        else:
            equal = attr.type == other.type and attr.value == other.value
        if not equal:
            raise NotReplicable(f"{what}: attribute {key} differs")


def _same_outside(va: ir.Value, vb: ir.Value, names: str, ia: int, what: str) -> None:
    """An input from outside both layers: the layer's own parameter, or a value they share."""
    if va is vb:
        return
    own_a, own_b = f"{names}.{ia}.", f"{names}.{ia + 1}."
    if va.is_initializer() and vb.is_initializer():
        na, nb = va.name or "", vb.name or ""
        if na.startswith(own_a) or nb.startswith(own_b):
            if nb != own_b + na[len(own_a) :] or va.shape != vb.shape or va.dtype != vb.dtype:
                raise NotReplicable(f"{what}: parameters {na} and {nb} do not match")
            return
        if _equal_tensors(va.const_value, vb.const_value):
            return
    raise NotReplicable(f"{what}: takes different values from outside the layers")


def _equal_tensors(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.size > 4096:  # a large constant that is not a parameter: equal only if one object
        return a is b
    return np.array_equal(a.numpy(), b.numpy())


def _clone(graph, template, carry, previous, found, j) -> list[ir.Node]:
    """Layer ``j``: ``template``'s nodes with layer ``j``'s parameters, its inputs from the
    layer before taken from ``previous`` (the clone before it, or the template): ``carry``
    maps those inputs to (node, output) positions."""
    t = TRACED - 1
    own_t, own_j = f"{found.path}.{t}.", f"{found.path}.{j}."
    scope_t = re.compile(rf"'{re.escape(found.path)}\.{t}(?=['.])")
    scope_j = f"'{found.path}.{j}"
    mapped: dict[ir.Value, ir.Value] = {}
    nodes = []
    for node in template:
        inputs = []
        for v in node.inputs:
            if v is None:
                inputs.append(None)
            elif v in mapped:
                inputs.append(mapped[v])
            elif v in carry:
                m, o = carry[v]
                inputs.append(previous[m].outputs[o])
            elif v.is_initializer() and (v.name or "").startswith(own_t):
                inputs.append(_parameter(graph, v, own_j + v.name[len(own_t) :], found, j))
            else:
                inputs.append(v)
        outputs = [
            ir.Value(name=f"{o.name}_l{j}", shape=o.shape, type=o.type) for o in node.outputs
        ]
        props = dict(node.metadata_props)
        if SCOPES in props:
            props[SCOPES] = scope_t.sub(scope_j, props[SCOPES])
        copy = ir.Node(
            node.domain, node.op_type, inputs,
            [_copy_attr(a) for a in node.attributes.values()],
            overload=node.overload, outputs=outputs, version=node.version,
            name=f"{node.name}_l{j}" if node.name else None, metadata_props=props,
        )  # fmt: skip
        for o, c in zip(node.outputs, outputs, strict=True):
            mapped[o] = c
        nodes.append(copy)
    return nodes


def _copy_attr(attr: ir.Attr) -> ir.Attr:
    return ir.Attr(attr.name, attr.type, attr.value, doc_string=attr.doc_string)


def _parameter(graph, template: ir.Value, name: str, found: Plan, j: int):
    """Layer ``j``'s initializer ``name``: its tensor in the module, wrapped as the traced one."""
    if name in graph.initializers:
        return graph.initializers[name]
    attr = name[len(f"{found.path}.{j}.") :]
    layer = found.layers[j]
    try:
        tensor = layer.get_parameter(attr)
    except AttributeError:
        try:
            tensor = layer.get_buffer(attr)
        except AttributeError as exc:
            raise NotReplicable(f"layer {j} has no tensor {attr}") from exc
    const = type(template.const_value)(tensor.detach(), name=name)
    value = ir.Value(name=name, shape=template.shape, type=template.type, const_value=const)
    value.meta.update(template.meta)
    graph.register_initializer(value)
    return value
