"""Convert a graph's fp32 tensors to fp16 (or bf16), keeping the fp32 islands it is given.

Which nodes stay fp32 is measured, not chosen here (:mod:`tfgraph.precision.islands` runs the graph
and names them); this pass only rewrites types. With ``low`` the target type and ``keep``
the names of the island nodes:

1. A node outside the islands computes in ``low``: every fp32 value it produces becomes
   ``low``; an attribute that fixes fp32 (``Cast``'s ``to``, ``ConstantOfShape``'s and
   ``Constant``'s value, ``EyeLike``/``Random*``'s ``dtype``) names ``low`` instead.
2. An island node computes in fp32 as before.
3. An fp32 initializer (or ``Constant``) becomes ``low`` unless only island nodes read it.
   Converted fp16 constants are clipped to ±65504: a mask's ``finfo(float32).min`` becomes the
   lowest finite fp16, never ``-inf`` (a fully masked row of ``-inf`` turns into NaN in a
   softmax).
4. Where a value crosses between the two, one ``Cast`` per value and direction is inserted.
   Ops that read only their input's shape or cast it themselves (``Shape``, ``Size``,
   ``Cast``) take it as it is.
5. Graph inputs and outputs become ``low``; with ``keep_io_types`` they stay fp32 and are cast
   at the graph's edge.

Integer and boolean values are never touched. An output nothing reads loses its stated type
outside the islands: a norm kernel returns some statistics in fp32 whatever its input type,
others in it, and ONNX Runtime checks what is stated. ``modified`` is False when nothing is
fp32.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

logger = logging.getLogger(__name__)

FP32 = ir.DataType.FLOAT
FP16_MAX = 65504.0
# ops that read only a shape, or convert the input themselves: no Cast in front of them
TYPE_AGNOSTIC_INPUTS = {"Shape", "Size", "Cast"}
# ops whose fp32 output type comes from an attribute: (attribute, kind)
TYPED_BY_ATTRIBUTE = {
    "Cast": "to",
    "EyeLike": "dtype",
    "RandomNormal": "dtype",
    "RandomUniform": "dtype",
    "RandomNormalLike": "dtype",
    "RandomUniformLike": "dtype",
}


def _is_fp32(value: ir.Value | None) -> bool:
    return value is not None and value.dtype == FP32


def _low_array(array: np.ndarray, low: ir.DataType) -> ir.TensorProtocol:
    if low == ir.DataType.FLOAT16:
        return ir.tensor(np.clip(array, -FP16_MAX, FP16_MAX).astype(np.float16))
    import ml_dtypes

    return ir.tensor(array.astype(ml_dtypes.bfloat16), dtype=low)


def _lowered(tensor, low: ir.DataType) -> ir.LazyTensor:
    """``tensor`` in ``low``, converted each time it is read: a checkpoint's weight is read
    (one tensor at a time) only as the artifact is written, as in fp32; a 7B model's fp16
    copy is never held whole. Tagged as derived, so the weight's checkpoint tensor stays
    known (the streamed reference of quantized weights)."""
    from tfgraph.passes.lazy_weights import DERIVED, derived

    def convert(array: np.ndarray) -> np.ndarray:
        return _low_array(array, low).numpy()

    lazy = derived(convert, [tensor], low, list(tensor.shape), tensor.name)
    lazy.meta[DERIVED] = ("cast", int(low), (tensor,))
    return lazy


def fill_float_types(model: ir.Model) -> int:
    """Type the untyped outputs of nodes outside the standard domain whose first input is
    fp32 (ONNX's shape inference does not know ``GroupQueryAttention``'s or
    ``SkipSimplifiedLayerNormalization``'s outputs, and they follow that input's type); the
    number typed."""
    count = 0
    for node in model.graph:
        first = node.inputs[0] if node.inputs else None
        if node.domain in ("", "ai.onnx") or not _is_fp32(first):
            continue
        for out in node.outputs:
            if out.dtype is None and out.name and out.uses():  # unread: a fixed-type statistic
                out.type = ir.TensorType(FP32)
                count += 1
    return count


class ConvertPrecisionPass(ir.passes.InPlacePass):
    """fp32 → ``low`` outside the ``keep`` islands (the cases of the module doc)."""

    def __init__(
        self, low: ir.DataType, keep: frozenset[str] = frozenset(), keep_io_types: bool = False
    ) -> None:
        super().__init__()
        if low not in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
            raise ValueError(f"cannot convert to {low}: fp16 or bf16 only")
        self.low, self.keep, self.keep_io_types = low, frozenset(keep), keep_io_types

    def _island(self, node: ir.Node) -> bool:
        return node.name in self.keep

    def _island_constant(self, node: ir.Node) -> bool:
        """A ``Constant`` only island nodes read stays fp32, as such an initializer does."""
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            return False
        users = [u.node for u in node.outputs[0].uses()]
        return bool(users) and all(map(self._island, users))

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        low = self.low
        fill_float_types(model)
        home: dict[ir.Value, ir.DataType] = {}  # the type each fp32 value will have
        for value in graph.inputs:
            if _is_fp32(value):
                home[value] = FP32 if self.keep_io_types else low
        for value in graph.initializers.values():
            if _is_fp32(value) and not value.is_graph_input():
                users = [u.node for u in value.uses()]
                home[value] = FP32 if users and all(map(self._island, users)) else low
        outputs = set(graph.outputs)
        for node in graph:
            island = self._island(node) or self._island_constant(node)
            for out in node.outputs:
                # an unread output keeps its type: statistics a norm kernel returns in fp32
                # whatever its input (LayerNormalization's mean, the skip norms' inv_std_var)
                if not _is_fp32(out):
                    continue
                if out.uses() or out in outputs:
                    home[out] = FP32 if island else low
                elif not island:
                    out.type = None  # the kernel decides (T or its fixed fp32): not stated
        if not home:
            return ir.passes.PassResult(model, modified=False)
        self._retype_nodes(graph)
        for value, dtype in home.items():
            if dtype == low:
                self._lower(value)
        self._insert_casts(graph, home)
        self._edge_outputs(graph, home)
        logger.info(
            "precision %s: %d values converted, %d nodes kept in fp32",
            low.name.lower(),
            sum(d == low for d in home.values()),
            sum(1 for n in graph if self._island(n)),
        )
        return ir.passes.PassResult(model, modified=True)

    def _retype_nodes(self, graph: ir.Graph) -> None:
        """Case 1: attributes that fix fp32 in nodes outside the islands."""
        for node in graph:
            if self._island(node) or self._island_constant(node):
                continue
            if node.domain not in ("", "ai.onnx"):
                continue
            attr = TYPED_BY_ATTRIBUTE.get(node.op_type)
            if attr is not None and node.attributes.get_int(attr) == FP32:
                node.attributes[attr] = ir.AttrInt64(attr, self.low)
            elif node.op_type in ("Constant", "ConstantOfShape"):
                for name in ("value_float", "value_floats"):
                    if name in node.attributes:  # a Constant's plain floats: as a tensor
                        array = np.asarray(node.attributes.pop(name).value, np.float32)
                        node.attributes["value"] = ir.AttrTensor("value", ir.tensor(array))
                tensor = node.attributes.get_tensor("value")
                if tensor is not None and tensor.dtype == FP32:
                    node.attributes["value"] = ir.AttrTensor(
                        "value", _low_array(tensor.numpy(), self.low)
                    )

    def _lower(self, value: ir.Value) -> None:
        """A value's type (and an initializer's data, converted when it is read) becomes
        ``low``."""
        if value.const_value is not None and value.is_initializer():
            value.const_value = _lowered(value.const_value, self.low)
        # a fresh type: values may share one TensorType object, and setting ``dtype`` changes
        # that object for all of them (an island's output turned bf16 with its neighbour's)
        value.type = ir.TensorType(self.low)

    def _insert_casts(self, graph: ir.Graph, home: dict) -> None:
        """Case 4: one Cast per crossing value and direction, in front of its first reader."""
        casts: dict[tuple[ir.Value, ir.DataType], ir.Value] = {}
        for node in list(graph):
            if node.op_type in TYPE_AGNOSTIC_INPUTS and node.domain in ("", "ai.onnx"):
                continue
            wanted = FP32 if self._island(node) else self.low
            for index, value in enumerate(node.inputs):
                if value is None or value not in home or home[value] == wanted:
                    continue
                key = (value, wanted)
                if key not in casts:
                    cast = ir.node("Cast", [value], attributes={"to": wanted})
                    cast.name = f"{value.name}__to_{wanted.name.lower()}"
                    out = cast.outputs[0]
                    out.name, out.dtype, out.shape = cast.name, wanted, value.shape
                    graph.insert_before(node, cast)
                    casts[key] = out
                node.replace_input_with(index, casts[key])

    def _edge_outputs(self, graph: ir.Graph, home: dict) -> None:
        """Case 5: graph outputs of the wrong type are cast at the edge, keeping their names."""
        wanted = FP32 if self.keep_io_types else self.low
        for i, value in enumerate(list(graph.outputs)):
            if value not in home or home[value] == wanted:
                continue
            name = value.name
            cast = ir.node("Cast", [value], attributes={"to": wanted})
            value.name = f"{name}__{home[value].name.lower()}"
            out = cast.outputs[0]
            out.name, out.dtype, out.shape = name, wanted, value.shape
            graph.append(cast)
            graph.outputs[i] = out
