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
- past inputs and present outputs become int8 (``manifest.json`` says it per port, and
  ``kv_quantization``: dtype, granularity, scale tensors and the measured ranges); the
  runners allocate the buffers in the dtype the graph takes, so ``generate``, in-flight
  batching and the Triton model follow.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tfgraph import contract
from tfgraph.errors import TfgraphError
from tfgraph.passes.rewrite_utils import add_initializer

logger = logging.getLogger(__name__)

KV_DTYPES = ("fp32", "int8")
GRANULARITIES = ("per-channel", "per-tensor")
QUANT_TYPES = {"per-channel": "PER_CHANNEL", "per-tensor": "PER_TENSOR"}
KV_QUANT_KEY = contract.KV_QUANT_KEY  # model metadata: what the manifest states
_MS = "com.microsoft"


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
            "for the ort or onnx target"
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
    from tfgraph.compile.pipeline import run_in_ort

    roles = contract.read_roles(model.metadata_props)
    present = {
        (role, layer): name
        for name, (role, layer) in roles.items()
        if role in (contract.PRESENT_KEY, contract.PRESENT_VALUE)
    }
    out = {}
    for result in run_in_ort(model, feeds):
        for layer in {lay for _, lay in present}:
            pair = []
            for role in (contract.PRESENT_KEY, contract.PRESENT_VALUE):
                x = np.abs(result[present[(role, layer)]].astype(np.float64))  # (B, KV, S, D)
                pair.append(x.max(axis=(0, 2)) if granularity == "per-channel" else x.max())
            if layer in out:
                pair = [np.maximum(a, b) for a, b in zip(out[layer], pair, strict=True)]
            out[layer] = tuple(pair)
    return out


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


def _scatter_int8(graph: ir.Graph, layer: Layer, scales) -> list[ir.Value]:
    """A static cache in int8: the new rows quantized before TensorScatter writes them into
    the int8 buffer, the buffer dequantized where the attention reads it (the present output
    stays the int8 buffer)."""
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
        dequantize = ir.node("DequantizeLinear", [present, value, zero])
        graph.insert_after(node, dequantize)
        readers = [(u.node, u.idx) for u in present.uses() if u.node is not dequantize]
        for reader, index in readers:
            reader.replace_input_with(index, dequantize.outputs[0])
        dequantize.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
        dequantize.outputs[0].shape = present.shape
        for v in (past, present, quantize.outputs[0]):
            v.type = ir.TensorType(ir.DataType.INT8)
    return names


def kv_quantization(model: ir.Model) -> dict | None:
    """What ``manifest.json`` states of an int8 cache (``None`` for a float one)."""
    raw = model.metadata_props.get(KV_QUANT_KEY)
    return json.loads(raw) if raw else None
