"""Run tfgraph artifacts through the runner protocol (:mod:`.runner`): ONNX Runtime sessions
(CPU by default; CUDA when installed), and token generation with KV-cached artifacts."""

from .generate import CachedDecoder, Generation, GenerationConfig, generate
from .runner import RUNNERS, KVCache, Runner, open_runner
from .session import PROVIDERS, Session, model_path

__all__ = [
    "PROVIDERS",
    "RUNNERS",
    "CachedDecoder",
    "Generation",
    "GenerationConfig",
    "KVCache",
    "Runner",
    "Session",
    "generate",
    "model_path",
    "open_runner",
]
