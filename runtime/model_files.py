"""Where an artifact's graph is and whether ONNX Runtime may read it: the step graph named by
``manifest.json`` (its first file: ``model.onnx``, or ``onnx/model.onnx`` in the ``optimum``
flavour), the manifest found for a graph file, and the check that every external-data
location names a file inside the model's directory (no ``..``, no absolute path, no symlink
leading out) before any ONNX library reads it.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Mapping
from pathlib import Path, PureWindowsPath

from tfgraph import contract
from tfgraph.errors import TfgraphError, first_line
from tfgraph.exporters.manifest import read_manifest


def step_file(manifest: Mapping | None) -> str:
    """The step graph of an artifact, relative to its directory: the manifest's first file
    (``onnx/model.onnx`` in the ``optimum`` flavour), ``model.onnx`` without a manifest."""
    files = (manifest or {}).get("files") or []
    first = files[0] if files and isinstance(files[0], str) else ""
    if not first.endswith(".onnx"):
        return contract.MODEL_FILE
    if os.path.isabs(first) or PureWindowsPath(first).anchor or ".." in Path(first).parts:
        raise TfgraphError(
            f"the manifest names the model '{first}', outside the artifact; re-export it"
        )
    return first


def model_path(path: str | Path) -> Path:
    """The step graph of an artifact directory (:func:`step_file`), the path itself for an
    ``.onnx`` file."""
    path = Path(path)
    if path.is_dir():
        path = path / step_file(read_manifest(path))
    if not path.is_file():
        raise TfgraphError(f"no ONNX model at '{path}': give an artifact directory or a .onnx file")
    return path


def _manifest_of(model_file: Path) -> dict | None:
    """The manifest of the artifact ``model_file`` belongs to: beside it, or one folder up
    where that manifest lists it among its files (``onnx/model.onnx``, ``onnx/encoder.onnx``)."""
    manifest = read_manifest(model_file.parent)
    if manifest is not None:
        return manifest
    above = read_manifest(model_file.parent.parent)
    if above is not None and f"{model_file.parent.name}/{model_file.name}" in (
        above.get("files") or []
    ):
        return above
    return None


def checked_model(path: str | Path) -> tuple[Path, dict | None]:
    """``(model file, manifest or None)``, checked before any ONNX library reads the file: the
    manifest's format is one this tfgraph understands, and external data stays in its directory.
    """
    model_file = model_path(path)
    manifest = _manifest_of(model_file)
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
            f"cannot read '{model_file}' as ONNX ({first_line(exc)}); re-export it"
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
