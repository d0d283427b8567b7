"""Serving: Triton Inference Server model repositories and a launcher.

``write_repository(artifact, out)`` is what ``python -m tfgraph triton`` runs
(:mod:`.repository`); :class:`~.launcher.TritonServer` runs the ``nvidia-pytriton`` wheel's
``tritonserver`` here (:mod:`.launcher`)."""

from .repository import write_repository

__all__ = ["write_repository"]
