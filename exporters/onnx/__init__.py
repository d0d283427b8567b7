"""The ``onnx`` target: standard ONNX only, with a static KV cache written in place."""
