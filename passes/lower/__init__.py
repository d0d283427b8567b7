"""Target-neutral lowering: canonical ops become what the target (handed in) chooses, and the
standard-ONNX forms every target can fall back to."""
