"""A graph serialized without its large weights: what the checker and shape inference need.

``serialize_model`` writes every initializer's bytes; for a checkpoint bound lazily
(:mod:`tfgraph.sources.streamed`) that would read the whole model into one protobuf on every
check. :func:`skeleton` writes initializers above ``limit`` bytes as graph inputs of the same
type and shape instead, without ever evaluating them.
"""

from __future__ import annotations

import contextlib
import logging

import onnx
import onnx_ir as ir

WEIGHT_LIMIT = 1 << 16


def skeleton(model: ir.Model, limit: int = WEIGHT_LIMIT) -> onnx.ModelProto:
    """``model`` as a proto whose initializers above ``limit`` bytes are graph inputs."""
    held: dict[ir.Value, object] = {}
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None and tensor.nbytes > limit:
            held[value] = tensor
    try:
        for value in held:
            value.const_value = None
        with _quiet_serde():  # it warns of each initializer without a value
            proto = ir.serde.serialize_model(model)
    finally:
        for value, tensor in held.items():
            value.const_value = tensor
    names = {i.name for i in proto.graph.input}
    for value in held:
        if value.name in names:
            continue
        proto.graph.input.append(
            onnx.helper.make_tensor_value_info(
                value.name,
                int(value.dtype),
                [d if isinstance(d, int) else None for d in value.shape],
            )
        )
    return proto


@contextlib.contextmanager
def _quiet_serde():
    serde_logger = logging.getLogger("onnx_ir.serde")
    level = serde_logger.level
    serde_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        serde_logger.setLevel(level)
