"""The name ``python -m tfgraph.serving.install`` keeps (README, docs/serving.md): serving lives
in :mod:`tfgraph.runtime.serving`."""


def __getattr__(name: str):
    if name == "write_repository":
        from tfgraph.runtime.serving.repository import write_repository

        return write_repository
    raise AttributeError(f"module 'tfgraph.serving' has no attribute '{name}'")


__all__ = ["write_repository"]
