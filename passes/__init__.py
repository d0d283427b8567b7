"""Graph passes on ``onnx_ir``: recognition into the ``tfgraph`` domain, then lowering."""

from .pipelines import PIPELINES, PROFILE_OPSET, get_pipeline

__all__ = ["PIPELINES", "PROFILE_OPSET", "get_pipeline"]
