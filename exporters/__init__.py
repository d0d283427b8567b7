"""Exporters: ONNX files (external data past 2 GB) in atomic artifact directories."""

from tfgraph.exporters.artifact import MANIFEST, check_target, staged_directory, write_json
from tfgraph.exporters.onnx_file import DATA_FILE, MODEL_FILE, save_onnx, weight_bytes

__all__ = [
    "DATA_FILE",
    "MANIFEST",
    "MODEL_FILE",
    "check_target",
    "save_onnx",
    "staged_directory",
    "weight_bytes",
    "write_json",
]
