"""Graph passes on ``onnx_ir``: recognition into the ``tfgraph`` domain, then lowering for a
target (:mod:`tfgraph.exporters.targets`). Nothing here imports torch."""

from tfgraph.passes.pipeline.build import PIPELINES, PipelineOptions, build_pipeline, pass_names

__all__ = ["PIPELINES", "PipelineOptions", "build_pipeline", "pass_names"]
