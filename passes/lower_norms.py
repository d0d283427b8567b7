"""Lower ``tfgraph.LayerNorm`` / ``tfgraph.RMSNorm`` to a target profile's kernels.

- LayerNorm → ``ort``: ``LayerNormalization`` (``com.microsoft.SkipLayerNormalization`` with
  the residual ``Add`` when ``skip_residual``); ``onnx`` and ``tensorrt``: ``LayerNormalization``.
- RMSNorm → ``ort``: ``SimplifiedLayerNormalization`` (ORT's kernel in the default domain;
  ``com.microsoft.SkipSimplifiedLayerNormalization`` with the residual when ``skip_residual``);
  ``onnx``: ``RMSNormalization`` (opset 23); ``tensorrt``: ``RMSNormalization`` from TensorRT
  10.15 on, else the decomposed ops.

Residual fusion (``ort`` with ``skip_residual=True``, for ONNX Runtime on CUDA)::

    a ─┐                            a ─┐
       Add ─► s ─► Norm ─► y   ⇒       SkipNorm ─► y
    b ─┘      └──► (other uses)     b ─┘   └─────► s  (output 3: a + b)

It applies when ``a`` and ``b`` have the same rank-2 or rank-3 shape (what ORT's kernels accept)
and the sum is not a graph output. It is off by default: on the CPU (onnxruntime 1.32, 2
threads, (1, 512, 768)) ``SkipLayerNormalization`` took 3.3 ms where ``Add`` +
``LayerNormalization`` took 0.24 ms and the decomposed ops 0.49 ms; ``SkipSimplified…`` 0.21 ms
against 0.09 ms for ``SimplifiedLayerNormalization`` (plus ~0.05 ms for the Add). A norm
without a scale gets ``γ = 1``.

Where the target cannot run a norm (``RMSNormalization`` below opset 23, or TensorRT older than
10.15) it is expanded back into standard ops and reported as missed with the reason.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from .rewrite_utils import DOMAIN, insert_tape, mark_missed, replace_value

logger = logging.getLogger(__name__)

PROFILES = ("ort", "onnx", "tensorrt")
MS_DOMAIN = "com.microsoft"


class LowerNormsPass(ir.passes.InPlacePass):
    """Replace every canonical norm by the profile's op (table in the module docstring)."""

    def __init__(
        self,
        profile: str,
        *,
        tensorrt_version: tuple[int, int] = (10, 15),
        skip_residual: bool = False,
    ) -> None:
        super().__init__()
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}")
        self.profile = profile
        self.tensorrt_version = tensorrt_version
        self.skip_residual = skip_residual

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = model.opset_imports.get("", 1)
        count = 0
        for node in list(graph):
            if node.domain != DOMAIN or node.op_type not in ("LayerNorm", "RMSNorm"):
                continue
            lowered = self._lower(model, node, opset)
            logger.debug("lowered %s to %s", node.name, lowered)
            count += 1
        return ir.passes.PassResult(model, modified=bool(count))

    def _lower(self, model: ir.Model, node: ir.Node, opset: int) -> str:
        graph = model.graph
        x, scale, bias = (list(node.inputs) + [None, None])[:3]
        eps = node.attributes["epsilon"].value
        rms = node.op_type == "RMSNorm"
        tape = ir.tape.Tape()
        if scale is None:
            scale = _ones_like_last_dim(tape, x)
        residual = _residual_add(graph, x) if self.profile == "ort" and self.skip_residual else None
        if residual is not None:
            add = x.producer()
            a, b = add.inputs
            inputs = [a, b, scale] + ([bias] if bias is not None else [])
            op = "SkipSimplifiedLayerNormalization" if rms else "SkipLayerNormalization"
            new = tape.op_multi_out(op, inputs, {"epsilon": eps}, num_outputs=4, domain=MS_DOMAIN)
            model.opset_imports.setdefault(MS_DOMAIN, 1)
            y, total = new[0], new[3]
            _keep_type(node.outputs[0], y)
            _keep_type(add.outputs[0], total)
            insert_tape(graph, node, tape)
            replace_value(node.outputs[0], y)
            replace_value(add.outputs[0], total)
            graph.remove([node, add], safe=True)
            return op
        if not rms:
            inputs = [x, scale] + ([bias] if bias is not None else [])
            y = tape.op("LayerNormalization", inputs, {"axis": -1, "epsilon": eps})
            op = "LayerNormalization"
        elif self.profile == "ort":
            y = tape.op(
                "SimplifiedLayerNormalization",
                [x, scale],
                {"axis": -1, "epsilon": eps, "stash_type": 1},
            )
            op = "SimplifiedLayerNormalization"
        elif opset >= 23 and (self.profile == "onnx" or self.tensorrt_version >= (10, 15)):
            y = tape.op("RMSNormalization", [x, scale], {"axis": -1, "epsilon": eps})
            op = "RMSNormalization"
        else:
            y = _decomposed_rms(tape, x, scale, eps, prefix=node.name or "rms")
            op = "decomposed"
            reason = (
                f"TensorRT {'.'.join(map(str, self.tensorrt_version))} does not parse "
                "RMSNormalization (10.15+ does)"
                if self.profile == "tensorrt" and self.tensorrt_version < (10, 15)
                else f"RMSNormalization needs opset 23; this graph is opset {opset}"
            )
            square_mean = next(n for n in tape.nodes if n.op_type == "ReduceMean")
            mark_missed(square_mean, reason)
        _keep_type(node.outputs[0], y)
        insert_tape(graph, node, tape)
        replace_value(node.outputs[0], y)
        graph.remove(node, safe=True)
        return op


def _keep_type(old: ir.Value, new: ir.Value) -> None:
    """Later lowerings look at shapes (residual fusion): keep what was known."""
    new.shape = old.shape
    new.type = old.type


def _residual_add(graph: ir.Graph, x: ir.Value) -> ir.Node | None:
    add = x.producer()
    if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
        return None
    a, b = add.inputs
    if a is None or b is None or a.shape is None or b.shape is None:
        return None
    if len(a.shape) not in (2, 3) or list(a.shape) != list(b.shape):
        return None
    if add.outputs[0].is_graph_output():
        return None
    return add


def _ones_like_last_dim(tape: ir.tape.Tape, x: ir.Value) -> ir.Value:
    dtype = x.dtype or ir.DataType.FLOAT
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
