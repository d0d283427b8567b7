"""Progress of long work, from library code that never prints.

A stage of an export announces itself with :func:`stage` and, when it loops over many things
(tensors written, layers run, decode steps), reports each with :func:`tick`. Whoever wants to
show it installs a :class:`Listener` with :func:`listening` (the CLI prints a line per stage
with what it took, and within a stage the count done with an estimate of the time left);
without one, ticks cost a context-variable lookup.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator


class Listener:
    """Told of stages and ticks; the default ignores them."""

    def started(self, name: str) -> None: ...

    def finished(self, name: str, seconds: float) -> None: ...

    def ticked(self, what: str, done: int, total: int, seconds: float) -> None: ...


_LISTENER: contextvars.ContextVar[Listener | None] = contextvars.ContextVar(
    "tfgraph_progress", default=None
)
_STARTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tfgraph_ticks", default=None)


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[Listener]:
    token = _LISTENER.set(listener)
    starts = _STARTS.set({})
    try:
        yield listener
    finally:
        _LISTENER.reset(token)
        _STARTS.reset(starts)


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    listener = _LISTENER.get()
    start = time.perf_counter()
    if listener is not None:
        listener.started(name)
    yield  # a stage that raises is not said to have finished
    if listener is not None:
        listener.finished(name, time.perf_counter() - start)


def tick(what: str, done: int, total: int) -> None:
    """``done`` of ``total`` ``what`` (``"tensors written"``) are done."""
    listener = _LISTENER.get()
    if listener is None:
        return
    starts = _STARTS.get()
    now = time.perf_counter()
    if starts is not None:
        if done <= 1 or what not in starts:
            starts[what] = now
        elapsed = now - starts[what]
    else:
        elapsed = 0.0
    listener.ticked(what, done, total, elapsed)


def eta(done: int, total: int, elapsed: float) -> float | None:
    """Seconds left at the pace so far (None before any is done)."""
    if done <= 0 or total <= done:
        return None if done <= 0 else 0.0
    return elapsed / done * (total - done)
