"""The ``tensorrt`` target: graphs TensorRT's ONNX parser takes, its static compat check and
engines."""
