"""The ``ort`` target's GELU: ONNX Runtime's contrib kernels, ``com.microsoft::Gelu(x)`` for
``approximate="none"`` and ``com.microsoft::FastGelu(x)`` for ``"tanh"`` (both in its CPU
provider, checked against ``torch.nn.functional.gelu`` to 1e-6). Handed to
:class:`~tfgraph.passes.lower.lower_gelu.LowerGeluPass` as ``Target.lower_gelu``."""

from __future__ import annotations

from tfgraph.exporters.ort.ops import FAST_GELU, GELU, MS_DOMAIN
from tfgraph.passes.canonical import GeluOp


def ms_gelu(op, x, spec: GeluOp, opset: int):
    """ONNX Runtime's contrib kernels (``op``: the rewriter's builder)."""
    ms_op = getattr(op, FAST_GELU if spec.approximate == "tanh" else GELU)
    return ms_op(x, _domain=MS_DOMAIN)
