"""Open an artifact (a directory with ``model.onnx``, or an ``.onnx`` file) with ONNX Runtime.

Before ONNX Runtime sees a file, it is checked: the artifact's ``manifest.json`` (if any) must be
of a format this tfgraph understands, and every external-data location must name a file inside
the model's directory (no ``..``, no absolute path, no symlink leading out).
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PureWindowsPath

import numpy as np

from tfgraph.errors import TfgraphError
from tfgraph.manifest import read_manifest

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


def checked_model(path: str | Path) -> tuple[Path, dict | None]:
    """``(model file, manifest or None)``, checked before any ONNX library reads the file: the
    manifest's format is one this tfgraph understands, and external data stays in its directory.
    """
    model_file = model_path(path)
    manifest = read_manifest(model_file.parent)
    check_external_data(model_file)
    return model_file, manifest


# An external-data entry always carries the key "location": field 1 (tag 0x0a), 8 bytes.
_LOCATION_KEY = b"\n\x08location"


def _may_have_external_data(model_file: Path) -> bool:
    """False when the file cannot reference external data (no ``location`` key in its bytes),
    so that the common inline model is not parsed twice."""
    with open(model_file, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return False
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(_LOCATION_KEY) >= 0


def _tensors(graph) -> Iterator:
    """Every TensorProto of a GraphProto: initializers, sparse ones, node attributes, subgraphs."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for sub in attr.graphs:
                yield from _tensors(sub)


def _location_problem(root: Path, location: str) -> str | None:
    if not location:
        return "has no location"
    if os.path.isabs(location) or PureWindowsPath(location).anchor:
        return "is an absolute path"
    if ".." in Path(location.replace("\\", "/")).parts:
        return "climbs out of the model directory"
    if not (root / location).resolve().is_relative_to(root):
        return "is a link that leads out of the model directory"
    return None


def check_external_data(model_file: Path) -> None:
    """Refuse a model whose external data lies outside its directory (ONNX Runtime would read
    any file the location names)."""
    if not _may_have_external_data(model_file):
        return
    import onnx

    try:
        proto = onnx.load(str(model_file), load_external_data=False)
    except Exception as exc:
        raise TfgraphError(
            f"cannot read '{model_file}' as ONNX ({_first_line(exc)}); re-export it"
        ) from exc
    root = model_file.parent.resolve()
    for tensor in _tensors(proto.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        problem = _location_problem(root, location)
        if problem:
            raise TfgraphError(
                f"'{model_file}' is refused: the external data '{location}' of tensor "
                f"'{tensor.name}' {problem}; external data must be a file beside the model"
            )


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# Named dims that count token positions: checked against the manifest's ``max_positions``.
SEQUENCE_DIMS = frozenset({"sequence", "decoder_sequence", "total_sequence"})


def _shape_text(shape: Sequence) -> str:
    dims = ["?" if d is None else str(d) for d in shape]
    return f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"


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

        self.path, self.manifest = checked_model(path)
        self.max_positions = (self.manifest or {}).get("max_positions")
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
                f"ONNX Runtime cannot load '{self.path}': {_first_line(exc)}; if the file is "
                "damaged or incomplete, export it again"
            ) from exc
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]
        self._input_types = {i.name: i.type for i in self._session.get_inputs()}
        self._input_shapes = {i.name: i.shape for i in self._session.get_inputs()}
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
        feeds = {name: self.check_input(name, inputs[name]) for name in self.input_names}
        outputs = self._session.run(None, feeds)
        return dict(zip(self.output_names, outputs, strict=True))

    def check_input(self, name: str, value: object) -> np.ndarray:
        """``value`` as the numpy array input ``name`` takes: dtype cast within its kind; rank,
        static dims and positions (``max_positions``) checked, naming the input."""
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
        self._check_shape(name, value.shape)
        return value

    def _check_shape(self, name: str, got: tuple[int, ...]) -> None:
        want = self._input_shapes.get(name)
        if want is None:
            return
        if len(got) != len(want) or any(
            isinstance(w, int) and w != g for w, g in zip(want, got, strict=True)
        ):
            raise TfgraphError(
                f"input '{name}' has shape {_shape_text(got)}, the model wants {_shape_text(want)}"
            )
        limit = self.max_positions
        for dim, size in zip(want, got, strict=True):
            if limit is not None and dim in SEQUENCE_DIMS and size > limit:
                raise TfgraphError(
                    f"input '{name}' has {size} positions ({dim}), more than the {limit} the "
                    "model supports (max_positions in manifest.json); shorten it"
                )
