"""Write an ``onnx_ir.Model`` as ``model.onnx``, with external data past protobuf's 2 GB limit."""

from __future__ import annotations

import logging
from pathlib import Path, PurePosixPath

import onnx_ir as ir

from tfgraph.passes.rewrite_utils import weight_bytes
from tfgraph.progress import tick

logger = logging.getLogger(__name__)

PROTOBUF_LIMIT = 2 * 1024**3
# Past this much weight the data goes to its own file whatever protobuf allows: an inline
# model is serialized whole in memory (twice, with its bytes) where external data is written
# one tensor at a time, and a session reads it without the protobuf copy (measured, 120M Llama
# int4: export peak 2.2 GiB inline; session RSS 277 MiB inline, 167 MiB external).
EXTERNAL_FROM = 64 * 1024**2
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"


def save_onnx(
    model: ir.Model,
    directory: Path,
    *,
    external_data: bool | None = None,
    name: str = MODEL_FILE,
) -> list[str]:
    """Save as ``directory/name``; ``external_data=None`` decides by size (above
    :data:`EXTERNAL_FROM`; the data file is ``name + ".data"``). Returns the file names.
    A ``name`` in a folder (``onnx/model.onnx``) is saved from inside it: external data is
    located relative to the model file, as ONNX Runtime reads it."""
    folder, base = PurePosixPath(name).parent, PurePosixPath(name).name
    if str(folder) != ".":
        (directory / folder).mkdir(parents=True, exist_ok=True)
        saved = save_onnx(model, directory / folder, external_data=external_data, name=base)
        return [f"{folder}/{file}" for file in saved]
    if external_data is None:
        external_data = weight_bytes(model) > EXTERNAL_FROM
    path = directory / name
    if external_data:
        data = DATA_FILE if name == MODEL_FILE else f"{name}.data"
        logger.info("saving %s with external data %s", path, data)

        def written(_tensor, info) -> None:
            tick("tensors written", info.index + 1, info.total)

        # one tensor at a time (a lazy one is read, converted or quantized as it is written);
        # the graph's initializers then refer to the written file instead of holding values
        ir.external_data.unload_from_model(
            model, directory, data, size_threshold_bytes=256, callback=written
        )  # as ir.save: small tensors stay inline (shape inference reads them)
        ir.save(model, path)
        return [name, data]
    ir.save(model, path)
    return [name]
