"""tfgraph: a graph compiler for Transformer models.

trace (torch.export → torch.onnx dynamo exporter → ``onnx_ir.Model``) → passes → ONNX →
ONNX Runtime, with every artifact proven against eager PyTorch.
"""

__version__ = "0.1.0"

ARTIFACT_FORMAT = 1  # bumped when manifest.json changes incompatibly

from .errors import ParityError, TfgraphError  # noqa: E402
from .export import ExportResult, export  # noqa: E402
from .sources import ModelSource, load_source  # noqa: E402

__all__ = [
    "ARTIFACT_FORMAT",
    "ExportResult",
    "ModelSource",
    "ParityError",
    "TfgraphError",
    "__version__",
    "export",
    "load_source",
]
