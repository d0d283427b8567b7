"""Interruptions that unwind: SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted`.

SIGTERM and SIGHUP end a Python process where it stands, without running ``finally`` blocks or
leaving ``with`` blocks, so an export killed that way would leave its staging directory behind.
While :func:`unwinding` is active (an export, an artifact being staged), those signals and
SIGINT raise :class:`Interrupted` in the main thread instead, and the work unwinds through its
cleanup. :func:`deferred` holds a signal back for a few lines that must not be cut in half (a
pair of renames, removing a directory); it is raised when they are done.

Only the main thread can install signal handlers: elsewhere both are no-ops. A signal whose
handler is not the default (ignored, as SIGHUP is under ``nohup``, or the application's own
handler) is left alone.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from functools import wraps
from typing import TypeVar

F = TypeVar("F", bound=Callable)

SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class Interrupted(KeyboardInterrupt):
    """The work was interrupted by ``signum``. A ``KeyboardInterrupt``, so that what already
    handles Ctrl-C (and no ``except Exception``) handles SIGTERM and SIGHUP alike."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {self.signal_name}")

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


class _State:
    installed = False
    deferring = 0
    pending: int | None = None


_STATE = _State()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _is_default(signum: int, handler) -> bool:
    if signum == signal.SIGINT and handler is signal.default_int_handler:
        return True
    return handler == signal.SIG_DFL


def _handler(signum: int, frame) -> None:
    if _STATE.deferring:
        if _STATE.pending is None:
            _STATE.pending = signum
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def unwinding() -> Iterator[None]:
    """Inside, SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted`; the handlers there before
    are restored on the way out. Nested uses and threads other than the main one: no change."""
    if _STATE.installed or not _in_main_thread():
        yield
        return
    previous = {}
    for signum in SIGNALS:
        handler = signal.getsignal(signum)
        if _is_default(signum, handler):
            previous[signum] = handler
            signal.signal(signum, _handler)
    _STATE.installed = True
    try:
        yield
    finally:
        _STATE.installed = False
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _STATE.pending = None


def unwound(fn: F) -> F:
    """``fn`` run inside :func:`unwinding`."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        with unwinding():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A signal that arrives inside is raised when the block ends, not in the middle of it. If
    the block raises, that exception goes on (the work stops either way)."""
    if not (_STATE.installed and _in_main_thread()):
        yield
        return
    _STATE.deferring += 1
    try:
        yield
    except BaseException:
        if _STATE.deferring == 1:
            _STATE.pending = None
        raise
    finally:
        _STATE.deferring -= 1
    if _STATE.deferring == 0 and _STATE.pending is not None:
        signum, _STATE.pending = _STATE.pending, None
        raise Interrupted(signum)
