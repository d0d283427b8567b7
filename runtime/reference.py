"""The ``onnx-reference`` runner: ONNX's own reference evaluator (``onnx.reference``).

ONNX Runtime's CPU provider has no bf16 kernels at all, so bf16 artifacts of the standard-ONNX
targets (``onnx``, ``tensorrt``) are run here by the evaluator the ONNX project ships: numpy,
op by op, bf16 through ``ml_dtypes``. It is slow (every op in Python) and meant for the tiny
models that prove a graph; it implements the runner protocol, so parity, cache parity and
``generate`` work on it. Its caches are numpy arrays: empty pasts the graph extends
(``Concat``), or zero buffers of the cache's capacity the graph writes into (the standard
targets' static cache, ``TensorScatter``), the past length fed as ``past_sequence_length``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from tfgraph import contract
from tfgraph.errors import TfgraphError, first_line
from tfgraph.runtime.runner import RUNNERS, KVCache, RoleKey
from tfgraph.runtime.session import _PAST_ROLES, _PRESENT_PAST, checked_model, state_zeros

logger = logging.getLogger(__name__)

NAME = "onnx-reference"


def _numpy_type(elem_type: int):
    import onnx

    if elem_type == onnx.TensorProto.BFLOAT16:
        import ml_dtypes

        return ml_dtypes.bfloat16
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type)


class ReferenceRunner:
    """An artifact's graph in ``onnx.reference.ReferenceEvaluator``."""

    def __init__(self, path: str | Path, **_options) -> None:
        import onnx
        from onnx.reference import ReferenceEvaluator

        self.path, self.manifest = checked_model(path)
        self.max_positions = (self.manifest or {}).get("max_positions")
        try:
            proto = onnx.load(self.path)
            self._evaluator = ReferenceEvaluator(proto)
        except Exception as exc:
            raise TfgraphError(
                f"the ONNX reference evaluator cannot load '{self.path}': {first_line(exc)}"
            ) from exc
        graph = proto.graph
        self.input_names = [i.name for i in graph.input]
        self.output_names = [o.name for o in graph.output]
        self._types = {v.name: v.type.tensor_type for v in [*graph.input, *graph.output]}
        stated = None
        if self.manifest is not None:
            stated = contract.signature_from_manifest(self.manifest, self.path.name)
        if stated is None:
            meta = {p.key: p.value for p in proto.metadata_props}

            def triples(values):
                return [
                    (
                        v.name,
                        f"tensor({onnx.helper.tensor_dtype_to_string(v.type.tensor_type.elem_type)})",
                        [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim],
                    )
                    for v in values
                ]

            stated = contract.build_signature(triples(graph.input), triples(graph.output), meta)
        self.signature = stated

    @property
    def device(self) -> str:
        return "cpu"

    def _dtype(self, name: str):
        return _numpy_type(self._types[name].elem_type)

    def _evaluate(self, feeds: dict) -> dict:
        try:
            outputs = self._evaluator.run(None, feeds)
        except Exception as exc:
            raise TfgraphError(
                f"the ONNX reference evaluator could not run '{self.path}': {first_line(exc)}"
            ) from exc
        return dict(zip(self.output_names, outputs, strict=True))

    def run(self, inputs: Mapping[str, object], *, native: bool = False) -> dict:
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise TfgraphError(f"inputs do not match the model: missing {missing}")
        feeds = {}
        for name in self.input_names:
            value = inputs[name]
            array = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
            feeds[name] = array.astype(self._dtype(name))
        return self._evaluate(feeds)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """Empty pasts (a copying cache), or zero buffers of ``capacity`` positions (a buffer
        layout: the graph writes each step's keys and values into them)."""
        buffered = self.signature.shared_buffer
        values = {}
        for port in self.signature.inputs_with(*_PAST_ROLES):
            dims = self._types[port.name].shape.dim
            if port.role in contract.STATE_ROLES:
                static = [d.dim_value if d.HasField("dim_value") else None for d in dims]
                values[port.key] = state_zeros(batch, static, self._dtype(port.name))
                continue
            shape = (batch, dims[1].dim_value, capacity if buffered else 0, dims[3].dim_value)
            values[port.key] = np.zeros(shape, self._dtype(port.name))
        return KVCache(values, 0, capacity if buffered else None)

    def step(
        self, feeds: Mapping[RoleKey, object], cache: KVCache, new_tokens: int
    ) -> tuple[dict[RoleKey, object], KVCache]:
        named = {}
        for port in self.signature.inputs:
            if port.role in _PAST_ROLES:
                named[port.name] = cache.values[port.key]
                continue
            if port.role == contract.PAST_LENGTH:  # a buffer layout: where the past ends
                named[port.name] = np.array([cache.length], self._dtype(port.name))
                continue
            if port.role == contract.PAST_LENGTHS:  # each row's own
                batch = np.shape(feeds[(contract.TOKEN_IDS, None)])[0]
                named[port.name] = cache.row_lengths(batch).astype(self._dtype(port.name))
                continue
            value = feeds.get(port.key)
            if value is None:
                raise TfgraphError(f"the model also needs input '{port.name}' ({port.role})")
            named[port.name] = np.asarray(value).astype(self._dtype(port.name))
        out = self._evaluate(named)
        outputs = {p.key: out[p.name] for p in self.signature.outputs}
        next_values = {
            (_PRESENT_PAST[p.role], p.layer): outputs[p.key]
            for p in self.signature.outputs
            if p.role in _PRESENT_PAST
        }
        return outputs, KVCache(next_values, cache.length + new_tokens, cache.capacity)

    def to_numpy(self, value):
        return np.asarray(value)

    def sibling(self, file: str) -> ReferenceRunner:
        return ReferenceRunner(self.path.parent / file)


RUNNERS[NAME] = ReferenceRunner
