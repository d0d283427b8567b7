"""Run tfgraph artifacts: ONNX Runtime sessions (CPU by default; CUDA/TensorRT when installed)
and token generation with KV-cached artifacts."""

from .generate import CachedDecoder, Generation, GenerationConfig, KVCache, generate
from .session import PROVIDERS, Session, model_path

__all__ = [
    "PROVIDERS",
    "CachedDecoder",
    "Generation",
    "GenerationConfig",
    "KVCache",
    "Session",
    "generate",
    "model_path",
]
