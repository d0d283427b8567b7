"""The ``ort`` and ``ort-cuda`` targets: ONNX Runtime's contrib kernels (``com.microsoft``), their
passes, weight formats and the paged KV cache. ONNX Runtime's op names live here only (and in
its runner, :mod:`tfgraph.runtime.session`)."""
