"""``LowerNormsPass``: every ``tfgraph.LayerNorm`` / ``tfgraph.RMSNorm`` becomes what its target
chooses (``Target.lower_norm``), built on a :class:`NormCase`, whose standard forms are:

- :meth:`~NormCase.layer_normalization`: ``LayerNormalization`` (opset 17);
- :meth:`~NormCase.rms_normalization`: ``RMSNormalization`` (opset 23);
- :meth:`~NormCase.decomposed`: RMSNorm expanded back into standard ops, reported as missed
  with the target's reason.

A target's own kernels are built by its folder on the same case (``ort``:
``tfgraph.exporters.ort.norms``, ONNX Runtime's RMSNorm and skip kernels); a kernel that
computes the residual ``Add`` the norm reads as well takes it over with
:meth:`~NormCase.absorb_add`. A norm without a scale gets ``γ = 1``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from tfgraph.passes.cache.split_encoder import cross_kv_entries
from tfgraph.passes.canonical import NORM_OPS, is_canonical
from tfgraph.passes.lower.lower_attention import Lowered
from tfgraph.passes.rewrite_utils import (
    LOWERED_FROM_KEY,
    import_used_domains,
    insert_tape,
    mark_missed,
    replace_value,
)
from tfgraph.passes.target_arg import require_target

logger = logging.getLogger(__name__)


@dataclass
class NormCase:
    """One canonical norm being lowered; its methods build the candidate ops on ``tape``."""

    graph: ir.Graph
    node: ir.Node
    x: ir.Value
    scale: ir.Value
    bias: ir.Value | None
    epsilon: float
    rms: bool
    opset: int
    tape: ir.tape.Tape = field(default_factory=ir.tape.Tape)
    replaced: list = field(default_factory=list)  # (old, new) values besides the output
    removed: list = field(default_factory=list)  # nodes removed besides the canonical one

    def layer_normalization(self, *, keep_residual_apart: bool = False) -> Lowered:
        """``LayerNormalization``. ``keep_residual_apart``: where the norm reads a rank-3
        ``Add`` that feeds nothing else (what ONNX Runtime 1.32's ``SkipLayerNormFusion``
        matches: a post-LN block, a pre-LN model's final norm), read it through
        ``Reshape(s, [0, 0, -1])`` (a no-op ONNX Runtime runs as an alias), so that the fusion
        cannot turn the pair into ``SkipLayerNormalization``, 5–7× slower on the CPU
        (measured, ORT 1.32, (1, 512, 768): 1.14 ms against 0.20 ms) — in any session,
        whatever its options."""
        x = self.x
        add = x.producer()
        if (
            keep_residual_apart
            and add is not None
            and add.op_type == "Add"
            and add.domain in ("", "ai.onnx")
            and x.shape is not None
            and len(x.shape) == 3
            and len(x.uses()) == 1
            and not x.is_graph_output()
        ):
            keep = ir.tensor([0, 0, -1], dtype=ir.DataType.INT64)
            shape = self.tape.initializer(keep, name=f"{self.node.name or 'norm'}_keep_shape")
            x = self.tape.op("Reshape", [x, shape])
            x.shape, x.type = self.x.shape, self.x.type
        inputs = [x, self.scale] + ([self.bias] if self.bias is not None else [])
        y = self.tape.op("LayerNormalization", inputs, {"axis": -1, "epsilon": self.epsilon})
        return Lowered(y, "LayerNormalization")

    def rms_normalization(self) -> Lowered:
        attrs = {"axis": -1, "epsilon": self.epsilon}
        return Lowered(
            self.tape.op("RMSNormalization", [self.x, self.scale], attrs), "RMSNormalization"
        )

    def decomposed(self, reason: str) -> Lowered:
        y = _decomposed_rms(
            self.tape, self.x, self.scale, self.epsilon, prefix=self.node.name or "rms"
        )
        square_mean = next(n for n in self.tape.nodes if n.op_type == "ReduceMean")
        mark_missed(square_mean, reason)
        return Lowered(y, "decomposed")

    def absorb_add(self, add: ir.Node, total: ir.Value) -> None:
        """A kernel built on this case computes ``add``'s sum as ``total`` too (a skip norm):
        the ``Add`` is removed and its readers read ``total``."""
        _keep_type(add.outputs[0], total)
        self.replaced.append((add.outputs[0], total))
        self.removed.append(add)


class LowerNormsPass(ir.passes.InPlacePass):
    """Replace every canonical norm by its target's choice (see the module docstring).

    ``target``: a :class:`tfgraph.exporters.target.Target`
    (``tfgraph.exporters.targets.get_target(name)``).
    """

    def __init__(self, target) -> None:
        super().__init__()
        self.target = require_target(target)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = model.opset_imports.get("", 1)
        count = 0
        for node in list(graph):
            if not (is_canonical(node) and node.op_type in NORM_OPS):
                continue
            lowered = self._lower(model, node, opset)
            logger.debug("lowered %s to %s", node.name, lowered)
            count += 1
        if count:
            import_used_domains(model)
        return ir.passes.PassResult(model, modified=bool(count))

    def _lower(self, model: ir.Model, node: ir.Node, opset: int) -> str:
        graph = model.graph
        x, scale, bias = (list(node.inputs) + [None, None])[:3]
        spec = NORM_OPS[node.op_type].read(node)
        case = NormCase(graph, node, x, scale, bias, spec.epsilon, node.op_type == "RMSNorm", opset)
        if scale is None:
            case.scale = _ones_like_last_dim(case.tape, x, node.name or f"norm{id(node)}")
        result = self.target.lower_norm(case)
        _keep_type(node.outputs[0], result.value)
        insert_tape(graph, node, case.tape)
        for new in case.tape.nodes:
            new.metadata_props[LOWERED_FROM_KEY] = node.op_type
        name = node.outputs[0].name
        replace_value(node.outputs[0], result.value)
        if name in {n for n, _, _ in cross_kv_entries(model)}:  # a norm's output is a cross K
            result.value.name = name  # (Mllama's k_norm): the encoder split cuts there by name
        for old, new in case.replaced:
            replace_value(old, new)
        graph.remove([node, *case.removed], safe=True)
        return result.op


def _keep_type(old: ir.Value, new: ir.Value) -> None:
    """Later lowerings look at shapes (residual fusion): keep what was known."""
    new.shape = old.shape
    new.type = old.type


def _ones_like_last_dim(tape: ir.tape.Tape, x: ir.Value, prefix: str) -> ir.Value:
    """A norm without a weight (nanochat's ``F.rms_norm(x, (x.size(-1),))``): ones, a constant
    where the last axis is static. Read off ``Shape(x)`` it would make a cycle once the skip
    kernel replaces the ``Add`` that computes ``x`` (ONNX Runtime's skip kernel then declines)."""
    dtype = x.dtype or ir.DataType.FLOAT
    size = x.shape[-1] if x.shape is not None and len(x.shape) else None
    if isinstance(size, int):
        return tape.initializer(
            ir.tensor(np.ones(size, dtype=dtype.numpy())), name=f"{prefix}_ones"
        )
    last = tape.op("Shape", [x], {"start": -1})
    one = ir.tensor([1], dtype=dtype)
    return tape.op("ConstantOfShape", [last], {"value": one})


def _decomposed_rms(
    tape: ir.tape.Tape, x: ir.Value, scale: ir.Value, eps: float, *, prefix: str
) -> ir.Value:
    dtype = x.dtype or ir.DataType.FLOAT
    two = tape.initializer(ir.tensor(2.0, dtype=dtype), name=f"{prefix}_two")
    epsilon = tape.initializer(ir.tensor(eps, dtype=dtype), name=f"{prefix}_eps")
    axes = tape.initializer(ir.tensor([-1], dtype=ir.DataType.INT64), name=f"{prefix}_axes")
    mean_square = tape.op("ReduceMean", [tape.op("Pow", [x, two]), axes], {"keepdims": 1})
    rms = tape.op("Sqrt", [tape.op("Add", [mean_square, epsilon])])
    return tape.op("Mul", [tape.op("Div", [x, rms]), scale])
