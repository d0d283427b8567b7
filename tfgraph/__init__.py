"""tfgraph: a graph compiler for Transformer models.

trace (torch.export → torch.onnx dynamo exporter → ``onnx_ir.Model``) → passes → ONNX →
ONNX Runtime, with every artifact proven against eager PyTorch.

Heavy modules (torch) load on first use, so ``tfgraph.runtime`` runs without importing torch.
From Python (docs/python-api.md)::

    result = tfgraph.export(model, "out", tokenizer=tokenizer, kv_cache=True)
    tfgraph.load("out").generate("Hello", max_new_tokens=16)
"""

from tfgraph.errors import ParityError, TfgraphError

__version__ = "0.1.0"

ARTIFACT_FORMAT = 2  # bumped when manifest.json changes (2: roles, graphs, kv_layout, target)

# public names, loaded on first use (module under tfgraph): export loads torch, load does not
_LAZY = {
    "export": "exporting",
    "ExportResult": "exporting",
    "ExportOptions": "options",
    "load": "runtime.loaded",
    "LoadedModel": "runtime.loaded",
    "ModelSource": "sources",
    "load_source": "sources",
    "from_module": "sources",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tfgraph' has no attribute '{name}'")


def __dir__() -> list[str]:
    """The lazy names too, so that ``dir(tfgraph)`` and completion show them."""
    return sorted({*globals(), *_LAZY})


__all__ = ["ARTIFACT_FORMAT", "ParityError", "TfgraphError", "__version__", *_LAZY]
