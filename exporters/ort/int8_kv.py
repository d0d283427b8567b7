"""An int8 KV cache (``export --kv-cache --kv-dtype int8``): a quarter of fp32's cache bytes.

On the ``ort`` target every cached layer is a ``GroupQueryAttention`` over a shared buffer;
with ``kv_cache_bit_width=8`` the kernel stores the keys and values it appends as int8,
``round(x / scale)`` clamped to [−128, 127], and attends over ``int8 × scale`` (measured on
ONNX Runtime 1.32's CPU provider: the output equals fp32 attention over the fake-quantized
past and new keys and values to 5e-7; KERNELS.md). So:

- **scales** are measured on the parity inputs: the fp32 graph's prefill keys and values per
  layer, ``max |K| / 127`` (and V's) per channel (kv head × head dim; ``PER_CHANNEL``: the
  outlier channels of keys keep their own range) or per tensor (``PER_TENSOR``), stored as
  initializers ``kv_scales.{i}.key`` / ``.value`` beside the kernel's inputs;
- **the reference** that quantizes K/V the same way is the same fp32 graph with
  ``QuantizeLinear``/``DequantizeLinear`` (same scales, symmetric int8) on every key and value
  entering a cached attention (:func:`fake_quantize`). Parity then judges the int8 artifact
  against eager PyTorch by a derived rule (:mod:`tfgraph.verify.kv_quantization`): its error
  within twice the reference's own error (the quantization's effect on these inputs) plus
  the fp32 tolerance;
- past a size (:data:`STREAM_FROM`, as the artifact's external data) the graph is never
  serialized whole: calibration hands ONNX Runtime the weights in place, and the reference is
  saved with its weights pending, taken at parity from the written artifact's weight files
  (hard links), so no second copy of the weights is made on disk or in memory;
- past inputs and present outputs become int8 (``manifest.json`` says it per port, and
  ``kv_quantization``: dtype, granularity, scale tensors and the measured ranges); the
  runners allocate the buffers in the dtype the graph takes, so ``generate``, in-flight
  batching and the Triton model follow.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from tfgraph import contract
from tfgraph.errors import TfgraphError
from tfgraph.passes.rewrite_utils import add_initializer, weight_bytes

logger = logging.getLogger(__name__)

KV_DTYPES = ("fp32", "int8")
GRANULARITIES = ("per-channel", "per-tensor")
QUANT_TYPES = {"per-channel": "PER_CHANNEL", "per-tensor": "PER_TENSOR"}
KV_QUANT_KEY = contract.KV_QUANT_KEY  # model metadata: what the manifest states
_MS = "com.microsoft"
# past this much weight the graph is not serialized whole (protobuf's 2 GB limit, and a copy
# of every weight in memory): the artifact writer's own threshold for external data
# (exporters/onnx_file.py EXTERNAL_FROM; tests/exporters/ort/test_kv_int8.py holds them equal)
STREAM_FROM = 64 * 1024**2
PENDING = "tfgraph.pending-weights"  # where a reference's weights are until parity fills them
_INLINE_BYTES = 256  # smaller tensors stay in the graph (as the artifact writer keeps them)


def check_kv_dtype(
    kv_dtype: str, granularity: str, kv_cache: bool, target, precision: str = "fp32"
) -> None:
    if kv_dtype not in KV_DTYPES:
        raise TfgraphError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, not {kv_dtype!r}")
    if granularity not in GRANULARITIES:
        raise TfgraphError(
            f"--kv-scales must be one of {', '.join(GRANULARITIES)}, not {granularity!r}"
        )
    if kv_dtype == "fp32":
        return
    if not kv_cache:
        raise TfgraphError("--kv-dtype int8 quantizes the KV cache: add --kv-cache")
    if precision != "fp32":
        raise TfgraphError(
            f"--kv-dtype {kv_dtype} goes with an fp32 graph; --precision {precision} beside it "
            "is not supported yet (drop one of them)"
        )
    if kv_dtype not in target.kv_dtypes:
        have = ", ".join(target.kv_dtypes) or "none"
        raise TfgraphError(
            f"target '{target.name}' has no {kv_dtype} KV cache (it has: {have}); export "
            "for the ort, onnx or tensorrt target"
        )
    if granularity not in target.kv_scales:
        raise TfgraphError(
            f"target '{target.name}' takes --kv-scales {' or '.join(target.kv_scales)}, not "
            f"{granularity} (per-channel needs GroupQueryAttention: the ort target)"
        )


@dataclass
class Layer:
    """One cached layer: a GroupQueryAttention (``node``; ``ort``) or the two TensorScatter
    writes of a static cache (``scatters``: key, value; ``onnx``/``tensorrt``)."""

    index: int
    node: ir.Node | None
    kv_heads: int
    head_size: int
    heads: int
    scatters: tuple[ir.Node, ir.Node] | None = None

    def sources(self) -> tuple[ir.Value, ir.Value | None, ir.Value | None]:
        return self.node.inputs[0], self.node.inputs[1], self.node.inputs[2]


def cached_layers(model: ir.Model) -> list[Layer]:
    """The cached layers by layer index; refused when one is neither a GroupQueryAttention
    over its past nor a static TensorScatter cache (a layer lowered to MultiHeadAttention
    keeps a copying fp32 cache)."""
    roles = contract.read_roles(model.metadata_props)
    pasts = {n: layer for n, (role, layer) in roles.items() if role == contract.PAST_KEY}
    if model.metadata_props.get(contract.KV_LAYOUT_KEY) == "static":
        return _static_layers(model, roles)
    layers = {}
    for node in model.graph:
        if node.domain == _MS and node.op_type == "GroupQueryAttention" and len(node.inputs) > 3:
            past = node.inputs[3]
            if past is not None and past.name in pasts:
                heads = node.attributes.get_int("num_heads")
                kv_heads = node.attributes.get_int("kv_num_heads")
                size = past.shape[3]
                layers[pasts[past.name]] = Layer(pasts[past.name], node, kv_heads, size, heads)
    missing = sorted(set(pasts.values()) - set(layers))
    if missing:
        raise TfgraphError(
            f"an int8 KV cache needs every cached layer in GroupQueryAttention; layer "
            f"{missing[0]}'s cache is not (head size not a multiple of 8?); export it with "
            "the fp32 cache"
        )
    return [layers[i] for i in sorted(layers)]


def _static_layers(model: ir.Model, roles: dict) -> list[Layer]:
    scatters: dict[int, dict[str, ir.Node]] = {}
    for value in model.graph.inputs:
        role, layer = roles.get(value.name, (None, None))
        if role not in (contract.PAST_KEY, contract.PAST_VALUE):
            continue
        node = next((u.node for u in value.uses() if u.node.op_type == "TensorScatter"), None)
        if node is None:
            raise TfgraphError(f"an int8 KV cache: layer {layer}'s cache has no TensorScatter")
        scatters.setdefault(layer, {})[role] = node
    layers = []
    for i, s in sorted(scatters.items()):
        key, value = s[contract.PAST_KEY], s[contract.PAST_VALUE]
        dims = key.inputs[0].shape
        layers.append(Layer(i, None, dims[1], dims[3], 0, (key, value)))
    return layers


def calibrate(model: ir.Model, feeds: list[dict], granularity: str) -> dict[int, tuple]:
    """{layer: (k_max, v_max)}: the largest |K| and |V| of the fp32 graph's prefill on
    ``feeds``, per channel ((kv_heads, head_size)) or per tensor (scalars)."""
    roles = contract.read_roles(model.metadata_props)
    present = {
        (role, layer): name
        for name, (role, layer) in roles.items()
        if role in (contract.PRESENT_KEY, contract.PRESENT_VALUE)
    }
    out = {}
    for result in _prefill(model, feeds):
        for layer in {lay for _, lay in present}:
            pair = []
            for role in (contract.PRESENT_KEY, contract.PRESENT_VALUE):
                x = np.abs(result[present[(role, layer)]].astype(np.float64))  # (B, KV, S, D)
                pair.append(x.max(axis=(0, 2)) if granularity == "per-channel" else x.max())
            if layer in out:
                pair = [np.maximum(a, b) for a, b in zip(out[layer], pair, strict=True)]
            out[layer] = tuple(pair)
    return out


def streams(model: ir.Model) -> bool:
    """Whether ``model``'s weights pass :data:`STREAM_FROM` (never serialized whole)."""
    return weight_bytes(model) > STREAM_FROM


def _prefill(model: ir.Model, feeds: list[dict]) -> list[dict]:
    """The graph's outputs on ``feeds`` in ONNX Runtime; past :data:`STREAM_FROM` the session
    gets the weights in place (a tensor held by PyTorch is shared, a lazy one computed once)."""
    from tfgraph.passes.pipeline.run import run_in_ort

    if not streams(model):
        return run_in_ort(model, feeds)
    with weights_aside(model) as aside:
        data = ir.serde.serialize_model(model).SerializeToString()
    arrays = {name: np.ascontiguousarray(t.numpy()) for name, t in aside.items()}
    logger.info("calibrating with %d weights handed to ONNX Runtime in place", len(arrays))
    return run_in_ort(data, feeds, arrays)


@contextlib.contextmanager
def weights_aside(model: ir.Model) -> Iterator[dict]:
    """Within the block, every initializer of the main graph above :data:`_INLINE_BYTES` is an
    external-data placeholder at :data:`PENDING` (never read); yields ``{name: its tensor}``."""
    aside = {}
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is None or tensor.nbytes <= _INLINE_BYTES:
            continue
        aside[value.name] = (value, tensor)
        value.const_value = ir.ExternalTensor(
            PENDING, 0, tensor.nbytes, tensor.dtype, shape=tensor.shape, name=value.name
        )
    try:
        yield {name: tensor for name, (_, tensor) in aside.items()}
    finally:
        for value, tensor in aside.values():
            value.const_value = tensor


def save_reference(model: ir.Model, path: Path) -> None:
    """Save the reference at ``path``: with its own weight file (``model.onnx.data``) below
    :data:`STREAM_FROM`, else with its weights pending (:func:`fill_reference` takes the
    artifact's)."""
    if not streams(model):
        ir.save(model, path, external_data=f"{path.name}.data")
        return
    with weights_aside(model):
        ir.save(model, path)


def fill_reference(reference: Path, artifact_dir: Path) -> None:
    """Give the reference's pending weights those of the artifact in ``artifact_dir`` (the same
    tensors by name): external ones through hard links to its weight files beside the reference
    (a copy where the two directories are on different file systems), inline ones copied."""
    proto = onnx.load(str(reference), load_external_data=False)
    pending = [t for t in proto.graph.initializer if _location(t) == PENDING]
    if not pending:
        return
    stored = _artifact_tensors(artifact_dir)
    for tensor in pending:
        if tensor.name not in stored:
            raise TfgraphError(
                f"the int8 cache's reference needs weight '{tensor.name}', which the artifact "
                f"in {artifact_dir} does not hold; export with --kv-dtype fp32 and report this"
            )
        tensor.CopyFrom(stored[tensor.name])
        location = _location(tensor)
        if location is not None:
            _link(artifact_dir / location, reference.parent / location)
    onnx.save(proto, str(reference))
    logger.info("KV reference: %d weights taken from the artifact", len(pending))


def _location(tensor: onnx.TensorProto) -> str | None:
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    return next((e.value for e in tensor.external_data if e.key == "location"), "")


def _artifact_tensors(artifact_dir: Path) -> dict[str, onnx.TensorProto]:
    """The initializers of every graph of the artifact (step graph, split encoder), unread."""
    tensors = {}
    for path in sorted(artifact_dir.glob("*.onnx")):
        graph = onnx.load(str(path), load_external_data=False).graph
        tensors.update({t.name: t for t in graph.initializer})
    return tensors


def _link(source: Path, target: Path) -> None:
    if target.exists():
        return
    try:
        os.link(source, target)
    except OSError as exc:
        logger.warning("KV reference: copying %s (no hard link: %s)", source.name, exc)
        shutil.copyfile(source, target)


def scales_of(ranges: dict[int, tuple]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Symmetric int8 scales, ``max / 127`` (a channel that never moved gets a tiny scale)."""
    return {
        layer: tuple(np.maximum(np.asarray(r, np.float32) / 127.0, 1e-8) for r in pair)
        for layer, pair in ranges.items()
    }


class FakeQuantized:
    """The graph with QuantizeLinear/DequantizeLinear on every key and value entering a
    cached attention: the reference that quantizes K/V as the int8 kernel does. :meth:`undo`
    restores the graph."""

    def __init__(self, model: ir.Model, layers: list[Layer], scales: dict) -> None:
        self.model, self.rewired, self.added = model, [], []
        for layer in layers:
            k_scale, v_scale = scales[layer.index]
            if layer.scatters is not None:  # static cache: the new rows written, (B, KV, T, d)
                for node, scale, which in zip(layer.scatters, (k_scale, v_scale), "kv",
                                              strict=True):  # fmt: skip
                    name = f"kvref.{layer.index}.{which}"
                    self._wire(node, 1, self._qdq(node.inputs[1], scale, name))
                continue
            query, key, value = layer.sources()
            if key is not None:
                self._wire(layer.node, 1, self._qdq(key, k_scale, f"kvref.{layer.index}.k"))
                self._wire(layer.node, 2, self._qdq(value, v_scale, f"kvref.{layer.index}.v"))
            else:  # packed QKV: (B, T, (H + 2 KV)·d), only the K and V parts quantized
                d, kv = layer.head_size, layer.kv_heads
                split = self._node(
                    "Split",
                    [query, self._const(np.array([layer.heads * d, kv * d, kv * d]), "split")],
                    {"axis": -1},
                    num_outputs=3,
                )
                q, k, v = split.outputs
                k = self._qdq(k, k_scale, f"kvref.{layer.index}.k")
                v = self._qdq(v, v_scale, f"kvref.{layer.index}.v")
                packed = self._node("Concat", [q, k, v], {"axis": -1}).outputs[0]
                self._wire(layer.node, 0, packed)
        first = next(iter(model.graph))
        model.graph.insert_before(first, self.added)

    def _const(self, array: np.ndarray, name: str) -> ir.Value:
        node = ir.node("Constant", [], {"value": ir.tensor(array, name=name)})
        self.added.append(node)
        return node.outputs[0]

    def _node(self, op: str, inputs: list, attrs: dict, num_outputs: int = 1) -> ir.Node:
        node = ir.node(op, inputs, attrs, num_outputs=num_outputs)
        self.added.append(node)
        return node

    def _qdq(self, x: ir.Value, scale: np.ndarray, name: str) -> ir.Value:
        flat = np.asarray(scale, np.float32).reshape(-1)
        s = self._const(flat if flat.size > 1 else flat.reshape(()), f"{name}.scale")
        zero = self._const(np.zeros(flat.shape if flat.size > 1 else (), np.int8), f"{name}.zp")
        attrs = {"axis": -1} if flat.size > 1 else {}  # per channel: the (KV·d) last axis
        q = self._node("QuantizeLinear", [x, s, zero], attrs).outputs[0]
        return self._node("DequantizeLinear", [q, s, zero], attrs).outputs[0]

    def _wire(self, node: ir.Node, index: int, value: ir.Value) -> None:
        self.rewired.append((node, index, node.inputs[index]))
        node.replace_input_with(index, value)

    def undo(self) -> None:
        for node, index, original in self.rewired:
            node.replace_input_with(index, original)
        for node in reversed(self.added):
            self.model.graph.remove(node, safe=True)


def to_int8(model: ir.Model, layers: list[Layer], scales: dict, granularity: str, ranges) -> None:
    """Every cached GroupQueryAttention keeps an int8 cache with ``scales``; past inputs and
    present outputs become int8; what was done is recorded for the manifest."""
    graph = model.graph
    kind = QUANT_TYPES[granularity]
    stated = {}
    for layer in layers:
        k_max, v_max = ranges[layer.index]
        if layer.scatters is not None:
            names = _scatter_int8(graph, layer, scales[layer.index])
        else:
            names = _gqa_int8(graph, layer, scales[layer.index], kind)
        stated[str(layer.index)] = {
            "k_scale": names[0].name,
            "v_scale": names[1].name,
            "k_max": round(float(np.max(k_max)), 6),
            "v_max": round(float(np.max(v_max)), 6),
        }
    model.metadata_props[KV_QUANT_KEY] = json.dumps(
        {
            "dtype": "int8",
            "granularity": granularity,
            "scale": "max |x| / 127 over the parity inputs' prefill (symmetric, no zero point)",
            "layers": stated,
        },
        sort_keys=True,
    )
    logger.info("KV cache in int8 (%s scales) for %d layers", granularity, len(layers))


def _gqa_int8(graph: ir.Graph, layer: Layer, scales, kind: str) -> list[ir.Value]:
    """GroupQueryAttention keeps an int8 cache: its quantized-cache attributes and scale
    inputs; past and present int8."""
    node = layer.node
    names = []
    for which, scale in zip(("key", "value"), scales, strict=True):
        shape = (layer.kv_heads, 1, layer.head_size) if np.size(scale) > 1 else (1,)
        array = np.asarray(scale, np.float32).reshape(shape)
        names.append(add_initializer(graph, f"kv_scales.{layer.index}.{which}", array))
    if len(node.inputs) < 14:
        node.resize_inputs(14)
    node.replace_input_with(12, names[0])
    node.replace_input_with(13, names[1])
    node.attributes["kv_cache_bit_width"] = ir.AttrInt64("kv_cache_bit_width", 8)
    node.attributes["k_quant_type"] = ir.AttrString("k_quant_type", kind)
    node.attributes["v_quant_type"] = ir.AttrString("v_quant_type", kind)
    for value in (node.inputs[3], node.inputs[4], node.outputs[1], node.outputs[2]):
        value.type = ir.TensorType(ir.DataType.INT8)
    return names


# ops that only move values: the int8 buffer passes them before it is dequantized
_MOVES = frozenset({"Unsqueeze", "Squeeze", "Reshape", "Transpose", "Expand", "Slice"})


def _scatter_int8(graph: ir.Graph, layer: Layer, scales) -> list[ir.Value]:
    """A static cache in int8: the new rows quantized before TensorScatter writes them into
    the int8 buffer, the buffer dequantized where the attention first computes with it (the
    present output stays the int8 buffer)."""
    names = []
    for node, scale, which in zip(layer.scatters, scales, ("key", "value"), strict=True):
        scale_array = np.asarray(scale, np.float32).reshape(())
        value = add_initializer(graph, f"kv_scales.{layer.index}.{which}", scale_array)
        zero = add_initializer(graph, f"kv_zero_points.{layer.index}.{which}", np.array(0, np.int8))
        names.append(value)
        past, new, present = node.inputs[0], node.inputs[1], node.outputs[0]
        quantize = ir.node("QuantizeLinear", [new, value, zero])
        graph.insert_before(node, quantize)
        node.replace_input_with(1, quantize.outputs[0])
        for v in (past, present, quantize.outputs[0]):
            v.type = ir.TensorType(ir.DataType.INT8)
        _dequantize_where_computed(graph, present, value, zero)
    return names


def _moved(value: ir.Value) -> ir.Node | None:
    """The one op reading ``value`` (``Shape`` aside) when it only moves values, else None."""
    readers = [u for u in value.uses() if u.node.op_type != "Shape"]
    if len(readers) != 1:
        return None
    node, index = readers[0]
    moves = node.domain in ("", "ai.onnx") and node.op_type in _MOVES and index == 0
    return node if moves and not node.outputs[0].is_graph_output() else None


def _dequantize_where_computed(graph: ir.Graph, buffer: ir.Value, scale, zero) -> None:
    """``DequantizeLinear`` past the ops that only move the int8 ``buffer`` (the head repeat
    of grouped-query attention, the keys' transpose), before the first that computes.

    A DequantizeLinear whose one reader is such an op is moved past it by ONNX Runtime's
    QDQPropagationTransformer, which inserts a QuantizeLinear/DequantizeLinear pair; at opset
    21+ that QuantizeLinear carries ``output_dtype`` INT8, and QDQS8ToU8Transformer then turns
    the pair's zero point into uint8: the session fails ("output_dtype INT8 does not match
    y_zero_point type UINT8"). Placed here there is nothing to propagate; TensorRT moves
    DequantizeLinear the same way itself. ``Shape`` readers keep reading the int8 values.
    """
    value = buffer
    while (node := _moved(value)) is not None:
        value = node.outputs[0]
        value.type = ir.TensorType(ir.DataType.INT8)
    readers = [(u.node, u.idx) for u in value.uses() if u.node.op_type != "Shape"]
    dequantize = ir.node("DequantizeLinear", [value, scale, zero])
    graph.insert_after(value.producer(), dequantize)
    for reader, index in readers:
        reader.replace_input_with(index, dequantize.outputs[0])
    dequantize.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    dequantize.outputs[0].shape = value.shape


def kv_quantization(model: ir.Model) -> dict | None:
    """What ``manifest.json`` states of an int8 cache (``None`` for a float one)."""
    raw = model.metadata_props.get(KV_QUANT_KEY)
    return json.loads(raw) if raw else None
