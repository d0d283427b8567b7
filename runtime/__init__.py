"""Run tfgraph artifacts through the runner protocol (:mod:`.runner`): ONNX Runtime sessions
(CPU by default; CUDA when installed), ONNX's reference evaluator (bf16 artifacts), and token
generation with KV-cached artifacts."""

from tfgraph.runtime.drafters import DraftModel, PromptLookup
from tfgraph.runtime.generate import (
    CachedDecoder,
    Generation,
    GenerationConfig,
    Step,
    generate,
    stream,
)
from tfgraph.runtime.inflight import SlotBatcher, generate_inflight, inflight_support
from tfgraph.runtime.reference import ReferenceRunner  # registers the onnx-reference runner
from tfgraph.runtime.runner import RUNNERS, KVCache, Runner, open_runner
from tfgraph.runtime.session import PROVIDERS, Session, model_path
from tfgraph.runtime.speculative_loop import speculative_generate, speculative_stream
from tfgraph.runtime.tensorrt_runner import (
    TensorRTRunner,  # registers the tensorrt runner (needs TensorRT)
)

__all__ = [
    "PROVIDERS",
    "RUNNERS",
    "CachedDecoder",
    "DraftModel",
    "Generation",
    "GenerationConfig",
    "KVCache",
    "PromptLookup",
    "ReferenceRunner",
    "Runner",
    "Session",
    "SlotBatcher",
    "Step",
    "TensorRTRunner",
    "generate",
    "generate_inflight",
    "inflight_support",
    "model_path",
    "open_runner",
    "speculative_generate",
    "speculative_stream",
    "stream",
]
