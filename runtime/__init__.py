"""Run tfgraph artifacts: ONNX Runtime sessions (CPU by default; CUDA/TensorRT when installed)."""

from .session import PROVIDERS, Session, model_path

__all__ = ["PROVIDERS", "Session", "model_path"]
