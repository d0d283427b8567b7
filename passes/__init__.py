"""Graph passes on ``onnx_ir``: recognition into the ``tfgraph`` domain, then lowering."""

from .pipelines import PIPELINES, get_pipeline

__all__ = ["PIPELINES", "get_pipeline"]
