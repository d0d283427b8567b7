"""The runner protocol: what ``run``, ``generate``, parity and a server need from a backend.

A runner opens one graph of an artifact and knows its :class:`~tfgraph.contract.Signature`
(from ``manifest.json``, else from the model's own role metadata). Inputs to :meth:`step` are
keyed by role (``(role, layer)``, :attr:`tfgraph.contract.Port.key`), never by name; the runner
binds them, feeds the cache (:class:`KVCache`, which it allocates and advances: a shared
preallocated buffer written in place, or a fresh past + new per step, as the artifact's
``kv_layout`` says) and returns the outputs by role. Values it returns may be its own device
values (an ``OrtValue``, a CUDA buffer); :meth:`to_numpy` copies one to the host.

:class:`tfgraph.runtime.session.Session` (ONNX Runtime) is one implementation;
:func:`open_runner` picks the one an artifact's target names (``RUNNERS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tfgraph.contract import Signature
from tfgraph.errors import TfgraphError

RoleKey = tuple[str, "int | None"]


@dataclass
class KVCache:
    """Per-layer past keys/values keyed by ``(past role, layer)``, as runner values, holding
    ``length`` positions; for a shared-buffer artifact each buffer has room for ``capacity``."""

    values: dict[RoleKey, Any]
    length: int = 0
    capacity: int | None = None
    # each row's past length when rows differ (in-flight batching; ``length`` is then the
    # longest); None: every row holds ``length``
    lengths: Any = None
    # the runner's host arrays behind ``values`` (ONNX Runtime: numpy arrays its OrtValues
    # share), so that rows of the buffer can be bound as a batch of their own (:meth:`rows`)
    host: dict[RoleKey, Any] | None = None

    def row_lengths(self, batch: int):
        """(batch,) int64: each row's past length."""
        import numpy as np

        if self.lengths is None:
            return np.full(batch, self.length, np.int64)
        return np.asarray(self.lengths, np.int64)


@runtime_checkable
class Runner(Protocol):
    path: Path
    signature: Signature
    max_positions: int | None

    @property
    def device(self) -> str:
        """Where it runs, e.g. ``cpu`` or ``cuda:0``."""

    def run(self, inputs: Mapping[str, Any], *, native: bool = False) -> dict[str, Any]:
        """One run on inputs keyed by name; outputs by name (numpy unless ``native``)."""

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache for ``batch`` rows and up to ``capacity`` positions."""

    def step(
        self, feeds: Mapping[RoleKey, Any], cache: KVCache, new_tokens: int
    ) -> tuple[dict[RoleKey, Any], KVCache]:
        """Run ``new_tokens`` positions on ``cache``; the outputs by role and the next cache."""

    def to_numpy(self, value: Any):
        """A runner value (or numpy array) as a numpy array on the host."""

    def rows(self, cache: KVCache, start: int, stop: int, lengths) -> KVCache:
        """Rows ``start:stop`` of a preallocated ``cache`` as a cache of their own (the same
        memory: a step on it writes those rows), each row at its own past length (``lengths``;
        in-flight batching, :mod:`tfgraph.runtime.inflight`)."""

    def sibling(self, file: str) -> Runner:
        """Another graph of the same artifact (``encoder.onnx``), opened the same way."""


# runner name (a target's ``runner``) → the class that opens an artifact with it; each
# implementation registers itself (``runtime/session.py``: ``onnxruntime``)
RUNNERS: dict[str, type] = {}


def open_runner(path: str | Path, runner: str | None = None, **options) -> Runner:
    """Open ``path`` with ``runner`` (default: the one its manifest's target names)."""
    if runner is None:
        from tfgraph.exporters.manifest import read_manifest

        path = Path(path)
        manifest = read_manifest(path if path.is_dir() else path.parent)
        runner = ((manifest or {}).get("target") or {}).get("runner", "onnxruntime")
    if runner not in RUNNERS:
        raise TfgraphError(
            f"no runner '{runner}' here (available: {', '.join(RUNNERS)}); run the artifact "
            "where its backend is installed"
        )
    return RUNNERS[runner](path, **options)
