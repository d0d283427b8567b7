"""What the sections of a quick run share: each model's source, its traces, identical exports.

``python -m tfgraph bench --quick`` is a smoke of every section, and most of its time went to
tracing the same tiny models again in each section that exports them (tracing is most of an
export's time): ``gpt-tiny`` in ``prefill`` and ``peers``, ``llama-tiny`` in
``attention_memory`` and, with the KV cache, five times in ``precision``. Inside a
:func:`scope` opened with ``quick=True``:

- :func:`source` makes each model once per key (one :class:`tfgraph.ModelSource` object);
- :func:`export` traces each source once per opset (a ``TraceCache``: the passes, the
  precision stages and parity still run per export), and an export with the same source and
  options as an earlier one in the scope is that one: ``out`` becomes a link to its artifact,
  which stays in the first section's workdir (the suite's scope ends before its temp dir).

A full run opens no scope: :func:`source` makes a fresh source and :func:`export` is
``tfgraph.export``, as before. ``compile_cost`` never goes through :func:`export` (it times
the trace); :func:`warm` tells it whether an export already ran in this process's scope, so
that a quick run needs no warm-up export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULTS = {"pipeline": "default", "target": "ort"}


class _Shared:
    def __init__(self) -> None:
        from tfgraph.sources.trace import TraceCache

        self.traces = TraceCache()
        self.sources: dict = {}
        self.results: dict = {}
        self.exports = 0  # tfgraph.export calls made in the scope
        self.reused = 0  # exports answered by an earlier identical one


_active: _Shared | None = None


@contextlib.contextmanager
def scope(quick: bool) -> Iterator[None]:
    """Share within the block when ``quick``; nested scopes are the outer one."""
    global _active
    if not quick or _active is not None:
        yield
        return
    _active = _Shared()
    try:
        yield
    finally:
        counts = stats()
        _active = None
        logger.info(
            "shared: %d exports, %d traces reused, %d exports reused",
            *counts.values(),
        )


def stats() -> dict | None:
    """The active scope's counts: ``exports`` made, ``traces_reused`` and ``exports_reused``
    (None outside a scope)."""
    if _active is None:
        return None
    return {
        "exports": _active.exports,
        "traces_reused": _active.traces.hits,
        "exports_reused": _active.reused,
    }


def warm() -> bool:
    """Whether an export has run in the active scope (its one-time setup is paid)."""
    return _active is not None and _active.exports > 0


def source(key: tuple, make: Callable[[], object]):
    """``make()``'s source, made once per ``key`` in a scope (``make()`` each time outside)."""
    if _active is None:
        return make()
    if key not in _active.sources:
        _active.sources[key] = make()
    return _active.sources[key]


def _options_key(options: dict) -> tuple:
    options = dict(options)
    if "profile" in options:  # the old name of target
        options["target"] = options.pop("profile")
    return tuple(sorted({**DEFAULTS, **options}.items()))


def export(model, out: Path, **options):
    """``tfgraph.export(model, out, **options)``; in a scope, through its trace cache and its
    earlier results. ``model``: a MODEL string (loaded once per scope) or a ModelSource."""
    import tfgraph

    out = Path(out)
    if _active is None:
        return tfgraph.export(model, out, **options)
    if isinstance(model, str | Path):
        name = str(model)
        model = source(("load", name), lambda: tfgraph.load_source(name))
    key = (id(model), _options_key(options))
    earlier = _active.results.get(key)
    if earlier is not None and earlier.out_dir.is_dir() and not (out.exists() or out.is_symlink()):
        _active.reused += 1
        logger.info("shared: %s is %s (the same export)", out, earlier.out_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.symlink_to(earlier.out_dir.resolve(), target_is_directory=True)
        return dataclasses.replace(earlier, out_dir=out)
    start, hits = time.process_time(), _active.traces.hits
    result = tfgraph.export(model, out, trace_cache=_active.traces, **options)
    logger.info(
        "shared: exported %s (%s) in %.1f s CPU%s",
        out.name,
        ", ".join(f"{k}={v}" for k, v in options.items()),
        time.process_time() - start,
        ", trace reused" if _active.traces.hits > hits else "",
    )
    _active.exports += 1
    _active.results[key] = result  # the source stays referenced by the trace cache and here
    _active.sources.setdefault(("object", id(model)), model)
    return result
