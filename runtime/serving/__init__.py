"""Serving: Triton Inference Server model repositories and a launcher.

``write_repository(artifact, out)`` is what ``python -m tfgraph triton`` runs
(:mod:`.repository`); :class:`~.launcher.TritonServer` runs the ``nvidia-pytriton`` wheel's
``tritonserver`` here (:mod:`.launcher`), from the server environment that
``python -m tfgraph.runtime.serving.install`` creates (:mod:`.install`: the wheel and the
``numpy<2``
its Python backend needs, apart from tfgraph's environment)."""


def __getattr__(name: str):
    # lazy, so that ``python -m tfgraph.runtime.serving.install`` runs before its module is imported
    if name == "write_repository":
        from tfgraph.runtime.serving.repository import write_repository

        return write_repository
    raise AttributeError(f"module 'tfgraph.runtime.serving' has no attribute '{name}'")


__all__ = ["write_repository"]
