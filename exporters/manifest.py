"""``manifest.json``: what an artifact is (signature with roles, KV layout, target, opsets,
passes, fusions, versions). The roles and the layout are :mod:`tfgraph.contract`'s; a runner or
a server drives the artifact from ``graphs`` (one signature per ONNX file) alone.

Readers check ``format`` first: an artifact written by a newer tfgraph (a higher format than
:data:`tfgraph.ARTIFACT_FORMAT`) is refused rather than misread.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
from pathlib import Path
from typing import TYPE_CHECKING

from tfgraph import ARTIFACT_FORMAT, __version__, contract
from tfgraph.errors import TfgraphError

if TYPE_CHECKING:
    import onnx_ir as ir

    from tfgraph.exporters.targets import Target

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


describe_value = contract.describe_value


def _target_entry(target: Target) -> dict:
    return {
        "name": target.name,
        "label": target.label,
        "version": list(target.version) if target.version else None,
        "runner": target.runner,
        "providers": list(target.session.providers),
    }


def build_manifest(
    model: ir.Model,
    *,
    origin: str,
    pipeline: str,
    target: Target,
    passes: list[dict],
    fusions: dict,
    files: list[str],
    kv_cache: bool = False,
    max_positions: int | None = None,
    encoder: ir.Model | None = None,
) -> dict:
    """``max_positions``: the most positions (past + new) the model supports, when the source
    says (learned position tables, a Hugging Face config's limit); ``None`` when unknown.
    ``encoder``: the encoder graph of a split encoder-decoder (``encoder.onnx``)."""
    signature = contract.signature_of(model)
    graphs = {contract.MODEL_FILE: {**signature.as_dict(), "kv_layout": signature.kv_layout}}
    if encoder is not None:
        graphs[contract.ENCODER_FILE] = {**contract.signature_of(encoder).as_dict()}
        graphs[contract.ENCODER_FILE]["kv_layout"] = None
    return {
        "format": ARTIFACT_FORMAT,
        "model": origin,
        "files": files,
        "inputs": [describe_value(v) for v in model.graph.inputs],  # roles: see "graphs"
        "outputs": [describe_value(v) for v in model.graph.outputs],
        "graphs": graphs,
        "kv_layout": signature.kv_layout,
        "opsets": dict(sorted(model.opset_imports.items())),
        "pipeline": pipeline,
        "target": _target_entry(target),
        "passes": passes,
        "fusions": {k: {"fused": v["fused"], "total": v["total"]} for k, v in fusions.items()},
        "kv_cache": kv_cache,
        # an int8 cache: dtype, granularity, scale tensors, measured ranges (else absent)
        **_kv_quantization(model),
        "max_positions": max_positions,
        "versions": versions(),
    }


def _kv_quantization(model: ir.Model) -> dict:
    raw = model.metadata_props.get(contract.KV_QUANT_KEY)
    return {"kv_quantization": json.loads(raw)} if raw else {}


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
