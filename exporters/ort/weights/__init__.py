"""ONNX Runtime's weight formats: ``MatMulNBits`` / ``GatherBlockQuantized`` through its own
quantizer,
the weights they compute with, and the eager reference of a weight-quantized artifact."""
