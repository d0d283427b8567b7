"""Precision and weights: fp16/bf16 with fp32 islands measured on the parity inputs
(:mod:`.islands`), int4/int8 weights through ONNX Runtime's MatMulNBits quantizer
(:mod:`.weights`) and the eager side of activation quantization (:mod:`.activations`)."""
