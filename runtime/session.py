"""Open an artifact (a directory with ``model.onnx``, or an ``.onnx`` file) with ONNX Runtime."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from tfgraph.errors import TfgraphError

logger = logging.getLogger(__name__)

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}

_ORT_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


def model_path(path: str | Path) -> Path:
    """``DIR/model.onnx`` for an artifact directory, the path itself for an ``.onnx`` file."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.onnx"
    if not path.is_file():
        raise TfgraphError(f"no ONNX model at '{path}': give an artifact directory or a .onnx file")
    return path


class Session:
    """An ONNX Runtime session over a tfgraph artifact.

    ``providers`` are names from :data:`PROVIDERS` in order of preference (CPU by default);
    asking for one that this ONNX Runtime build lacks is an error, not a silent fallback.
    ``optimize=False`` disables ONNX Runtime's own graph optimizations (used by tests, so that
    ORT's fusions cannot hide one that tfgraph failed to do).
    """

    def __init__(
        self,
        path: str | Path,
        providers: Sequence[str] = ("cpu",),
        *,
        optimize: bool = True,
        threads: int | None = None,
    ) -> None:
        import onnxruntime as ort

        self.path = model_path(path)
        self.providers, self.threads = tuple(providers), threads
        available = ort.get_available_providers()
        chosen = []
        for name in providers:
            if name not in PROVIDERS:
                raise TfgraphError(f"unknown provider '{name}': choose from {', '.join(PROVIDERS)}")
            if PROVIDERS[name] not in available:
                raise TfgraphError(
                    f"provider '{name}' is not in this ONNX Runtime build (available: "
                    f"{', '.join(available)}); install tfgraph[gpu] on a CUDA machine"
                )
            chosen.append(PROVIDERS[name])
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if not optimize:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        # On the CPU, ORT's own SkipLayerNormFusion turns Add + LayerNormalization into a
        # kernel measured 10× slower (docs/BENCHMARKS.md); keep the two ops there.
        disabled = ["SkipLayerNormFusion"] if chosen[0] == PROVIDERS["cpu"] else []
        try:
            self._session = ort.InferenceSession(
                str(self.path), options, providers=chosen, disabled_optimizers=disabled
            )
        except Exception as exc:
            raise TfgraphError(
                f"ONNX Runtime cannot load '{self.path}': {str(exc).splitlines()[0]}"
            ) from exc
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]
        self._input_types = {i.name: i.type for i in self._session.get_inputs()}
        logger.info("opened %s with %s", self.path, chosen)

    @property
    def ort_session(self):
        """The underlying ``onnxruntime.InferenceSession`` (IO binding, metadata)."""
        return self._session

    def run(self, inputs: Mapping[str, object]) -> dict[str, np.ndarray]:
        """Run on numpy arrays or torch tensors; returns ``{output name: numpy array}``."""
        missing = [n for n in self.input_names if n not in inputs]
        unknown = [n for n in inputs if n not in self.input_names]
        if missing or unknown:
            raise TfgraphError(
                f"inputs do not match the model: missing {missing}, unknown {unknown}; "
                f"it takes {self.input_names}"
            )
        feeds = {}
        for name in self.input_names:
            value = inputs[name]
            if hasattr(value, "detach"):  # torch.Tensor, without importing torch here
                value = value.detach().cpu().numpy()
            value = np.asarray(value)
            want = _ORT_DTYPES.get(self._input_types[name])
            if want is not None and value.dtype != want:
                if value.dtype.kind != np.dtype(want).kind:
                    raise TfgraphError(
                        f"input '{name}' has dtype {value.dtype}, the model wants {np.dtype(want)}"
                    )
                value = value.astype(want)
            feeds[name] = value
        outputs = self._session.run(None, feeds)
        return dict(zip(self.output_names, outputs, strict=True))
