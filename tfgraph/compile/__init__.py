"""Compile: the pass pipeline run over the traced graph (recognition, KV cache, the target's
lowering), each pass checked on request, and the per-layer fusion report."""
