"""For tests that start a process and send it Ctrl-C: pass ``preexec_fn=terminal_signals``."""

from __future__ import annotations

import signal


def terminal_signals() -> None:
    """In the child before it runs: SIGINT as a terminal leaves it (a test runner's worker may
    have it ignored, and an ignored SIGINT stays ignored across exec: uvicorn, which restores
    the handler it found after its graceful shutdown, then exits 0 instead of 130)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
