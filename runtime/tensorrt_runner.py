"""The ``tensorrt`` runner: an artifact's TensorRT engines (``python -m tfgraph engine``).

Implements the runner protocol (:mod:`.runner`) with TensorRT's Python API and torch CUDA
tensors as device buffers: ``set_input_shape`` per input (``set_tensor_address`` with a host
buffer for the past-length shape tensor), output buffers sized from the context's shapes,
``execute_async_v3`` on a CUDA stream. The KV cache stays on the device between steps: a
static (buffer) layout's present is written to a second buffer and the two swap each step
(TensorRT does not promise in-place aliasing of an input and an output); a copying cache's
present becomes the next past. ``run``, ``generate`` and ``parity`` then work on an engine.

Needs TensorRT and a CUDA GPU: opening one without them raises a one-line error. Not run on
the machines this project is developed on (``tools/gpu_check.sh`` does, where it can).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from tfgraph import contract
from tfgraph.errors import TfgraphError
from tfgraph.runtime.runner import RUNNERS, KVCache, RoleKey
from tfgraph.runtime.session import _PAST_ROLES, _PRESENT_PAST  # KV and the recurrent states

logger = logging.getLogger(__name__)

NAME = "tensorrt"


class TensorRTRunner:
    def __init__(self, path: str | Path, *, graph: str = "model.onnx", **_options) -> None:
        try:
            import tensorrt as trt
            import torch
        except ImportError as exc:
            raise TfgraphError(
                "the tensorrt runner needs TensorRT and torch with CUDA: run the engine on a "
                "machine that has them (tools/gpu_check.sh)"
            ) from exc
        if not torch.cuda.is_available():
            raise TfgraphError("the tensorrt runner needs a CUDA GPU; none is visible here")
        from tfgraph.exporters.manifest import read_manifest

        path = Path(path)
        self.directory = path if path.is_dir() else path.parent
        manifest = read_manifest(self.directory)
        engines = ((manifest or {}).get("engine") or {}).get("graphs") or {}
        if graph not in engines:
            raise TfgraphError(
                f"'{self.directory}' has no TensorRT engine for {graph}: build it with "
                f"`python -m tfgraph engine {self.directory}`"
            )
        self.path = self.directory / engines[graph]["file"]
        self.graph = graph
        self.signature = contract.signature_from_manifest(manifest, graph)
        self.max_positions = manifest.get("max_positions")
        self._trt, self._torch = trt, torch
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = runtime.deserialize_cuda_engine(self.path.read_bytes())
        if self._engine is None:
            raise TfgraphError(f"TensorRT could not load '{self.path}': rebuild the engine here")
        self._context = self._engine.create_execution_context()
        self._stream = torch.cuda.Stream()
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self.input_names = [n for n in names if self._engine.get_tensor_mode(n) == mode]
        self.output_names = [n for n in names if self._engine.get_tensor_mode(n) != mode]

    @property
    def device(self) -> str:
        return "cuda:0"

    def _dtype(self, name: str):
        numpy_type = self._trt.nptype(self._engine.get_tensor_dtype(name))
        return self._torch.from_numpy(np.empty(0, numpy_type)).dtype

    def _device(self, value, name: str):
        torch = self._torch
        tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
        return tensor.to(device="cuda", dtype=self._dtype(name)).contiguous()

    def _execute(self, tensors: Mapping[str, object], bound: Mapping[str, object]) -> dict:
        """Run on device ``tensors`` by input name; ``bound``: output name → a buffer to write
        into. Returns every output by name (device tensors)."""
        torch, context = self._torch, self._context
        keep = []
        for name in self.input_names:
            value = tensors[name]
            if self._engine.is_shape_inference_io(name):  # a shape tensor: host memory
                array = value.cpu() if hasattr(value, "cpu") else value
                host = np.ascontiguousarray(np.asarray(array), np.int64)
                keep.append(host)
                context.set_input_shape(name, host.shape)
                context.set_tensor_address(name, host.ctypes.data)
                continue
            context.set_input_shape(name, tuple(value.shape))
            context.set_tensor_address(name, value.data_ptr())
        outputs = {}
        for name in self.output_names:
            buffer = bound.get(name)
            if buffer is None:
                shape = tuple(context.get_tensor_shape(name))
                buffer = torch.empty(shape, dtype=self._dtype(name), device="cuda")
            outputs[name] = buffer
            context.set_tensor_address(name, buffer.data_ptr())
        if not context.execute_async_v3(self._stream.cuda_stream):
            raise TfgraphError(f"TensorRT failed to run '{self.path}'")
        self._stream.synchronize()
        return outputs

    def run(self, inputs: Mapping[str, object], *, native: bool = False) -> dict[str, object]:
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise TfgraphError(f"inputs do not match the engine: missing {missing}")
        tensors = {n: self._device(inputs[n], n) for n in self.input_names}
        outputs = self._execute(tensors, {})
        return outputs if native else {n: self.to_numpy(v) for n, v in outputs.items()}

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        torch = self._torch
        buffered = self.signature.shared_buffer
        values = {}
        for port in self.signature.inputs_with(*_PAST_ROLES):
            if port.role in contract.STATE_ROLES:  # fixed size, zeros before the first step
                shape = (batch, *port.shape[1:])
                values[port.key] = torch.zeros(shape, dtype=self._dtype(port.name), device="cuda")
                continue
            heads, size = port.shape[1], port.shape[3]
            shape = (batch, heads, capacity if buffered else 0, size)
            values[port.key] = torch.zeros(shape, dtype=self._dtype(port.name), device="cuda")
        return KVCache(values, 0, capacity if buffered else None)

    def step(
        self, feeds: Mapping[RoleKey, object], cache: KVCache, new_tokens: int
    ) -> tuple[dict[RoleKey, object], KVCache]:
        tensors = {}
        for port in self.signature.inputs:
            if port.role in _PAST_ROLES:
                tensors[port.name] = cache.values[port.key]
            elif port.role == contract.PAST_LENGTH:
                tensors[port.name] = np.array([cache.length], np.int64)
            elif port.role == contract.PAST_LENGTHS:
                batch = np.shape(feeds[(contract.TOKEN_IDS, None)])[0]
                tensors[port.name] = cache.row_lengths(batch)
            else:
                value = feeds.get(port.key)
                if value is None:
                    raise TfgraphError(f"the model also needs input '{port.name}' ({port.role})")
                tensors[port.name] = self._device(value, port.name)
        named = self._execute(tensors, {})
        outputs = {p.key: named[p.name] for p in self.signature.outputs}
        next_values = {
            (_PRESENT_PAST[p.role], p.layer): outputs[p.key]
            for p in self.signature.outputs
            if p.role in _PRESENT_PAST
        }
        return outputs, KVCache(next_values, cache.length + new_tokens, cache.capacity)

    def to_numpy(self, value):
        if isinstance(value, np.ndarray):
            return value
        value = value.detach().cpu()
        if value.dtype == self._torch.bfloat16:  # numpy has no bf16
            value = value.float()
        return value.numpy()

    def sibling(self, file: str) -> TensorRTRunner:
        return TensorRTRunner(self.directory, graph=file)


RUNNERS[NAME] = TensorRTRunner
