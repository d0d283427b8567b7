"""Source and trace: a model (preset, ``package.module:function`` factory, ``nn.Module``,
Hugging Face directory) becomes a :class:`ModelSource`, traced into ``onnx_ir``."""

from tfgraph.sources.loading import from_module, load_source
from tfgraph.sources.model import ModelSource, max_positions

__all__ = ["ModelSource", "from_module", "load_source", "max_positions"]
