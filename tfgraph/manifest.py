"""``manifest.json``: what an artifact is (signature, opsets, passes, fusions, versions).

Readers check ``format`` first: an artifact written by a newer tfgraph (a higher format than
:data:`tfgraph.ARTIFACT_FORMAT`) is refused rather than misread.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
from pathlib import Path
from typing import TYPE_CHECKING

from . import ARTIFACT_FORMAT, __version__
from .errors import TfgraphError

if TYPE_CHECKING:
    import onnx_ir as ir

MANIFEST_FILE = "manifest.json"

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
    max_positions: int | None = None,
) -> dict:
    """``max_positions``: the most positions (past + new) the model supports, when the source
    says (learned position tables, a Hugging Face config's limit); ``None`` when unknown."""
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
        "max_positions": max_positions,
        "versions": versions(),
    }


def read_manifest(directory: str | Path) -> dict | None:
    """The manifest of the artifact in ``directory`` (``None`` when it has none, as beside a
    bare ``.onnx`` file); refused when unreadable or written by a newer tfgraph."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TfgraphError(f"cannot read '{path}' ({exc}); re-export the artifact") from exc
    if not isinstance(manifest, dict):
        raise TfgraphError(f"'{path}' is not a tfgraph manifest; re-export the artifact")
    check_format(manifest.get("format", ARTIFACT_FORMAT), Path(directory))
    return manifest


def check_format(found: object, where: Path) -> None:
    """Refuse an artifact format this tfgraph does not understand."""
    if not isinstance(found, int) or isinstance(found, bool) or found < 1:
        raise TfgraphError(
            f"'{where / MANIFEST_FILE}' has format {found!r}, not a format number; "
            "re-export the artifact"
        )
    if found > ARTIFACT_FORMAT:
        raise TfgraphError(
            f"'{where}' was written by a newer tfgraph (format {found} > {ARTIFACT_FORMAT}): "
            "upgrade tfgraph"
        )
