"""``manifest.json``: what an artifact is (signature, opsets, passes, fusions, versions)."""

from __future__ import annotations

import importlib.metadata
import platform

import onnx_ir as ir

from . import ARTIFACT_FORMAT, __version__

_DEPENDENCIES = ("torch", "onnx", "onnx-ir", "onnxscript", "onnxruntime", "numpy", "transformers")


def versions() -> dict[str, str]:
    found = {"tfgraph": __version__, "python": platform.python_version()}
    for dist in _DEPENDENCIES:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def describe_value(value: ir.Value) -> dict:
    """Name, dtype and symbolic shape (named dims as strings, static ones as ints)."""
    dtype = value.dtype.name.lower() if value.dtype is not None else None
    shape = None
    if value.shape is not None:
        shape = [d if isinstance(d, int) else str(d.value) for d in value.shape]
    return {"name": value.name, "dtype": dtype, "shape": shape}


def build_manifest(
    model: ir.Model,
    *,
    origin: str,
    pipeline: str,
    profile: str,
    passes: list[dict],
    fusions: dict,
    files: list[str],
    kv_cache: bool = False,
) -> dict:
    return {
        "format": ARTIFACT_FORMAT,
        "model": origin,
        "files": files,
        "inputs": [describe_value(v) for v in model.graph.inputs],
        "outputs": [describe_value(v) for v in model.graph.outputs],
        "opsets": dict(sorted(model.opset_imports.items())),
        "pipeline": pipeline,
        "profile": profile,
        "passes": passes,
        "fusions": {k: {"fused": v["fused"], "total": v["total"]} for k, v in fusions.items()},
        "kv_cache": kv_cache,
        "versions": versions(),
    }
