"""The test suite. Its folders mirror the package (tests/passes/cache/ tests tfgraph.passes.cache,
tests/exporters/ort/ the ort target …); tests/e2e/ runs whole exports across stages; the modules
directly here test the tree as a whole (layering, backend names, the same graphs) or are the
helpers the tests share, importable by their names (pyproject's pytest ``pythonpath``)."""
