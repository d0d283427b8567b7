"""Atomic artifact directories: everything is written into a hidden staging directory beside
the target and renamed into place only when complete, so a failure or an interrupt (SIGINT,
SIGTERM, SIGHUP) leaves nothing behind; what a killed process left, the next one sweeps."""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tfgraph.errors import TfgraphError
from tfgraph.interrupts import deferred, unwinding

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def check_target(out_dir: Path, marker: str = MANIFEST, kind: str = "artifact") -> None:
    """Fail early (before any work) on an output directory that cannot be written. A non-empty
    one is replaced only when it holds ``marker`` (it is tfgraph's own ``kind``)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise TfgraphError(f"output '{out_dir}' exists and is not a directory; choose another -o")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / marker).is_file():
        raise TfgraphError(
            f"output directory '{out_dir}' is not empty and is not a tfgraph {kind}; "
            f"choose another -o (tfgraph only replaces its own {kind}s)"
        )
    existing = out_dir.resolve().parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise TfgraphError(f"'{existing}' is not a directory; choose another -o")
    if not os.access(existing, os.W_OK):
        raise TfgraphError(f"cannot write to '{existing}': permission denied; choose another -o")


@contextlib.contextmanager
def staged_directory(
    out_dir: Path, marker: str = MANIFEST, kind: str = "artifact"
) -> Iterator[Path]:
    """Yield a staging directory; on success it replaces ``out_dir``, on error it is removed.

    An ``OSError`` on the way (a full disk, a directory that cannot be written) becomes a
    :class:`TfgraphError` naming ``out_dir``; nothing is left behind either way. Meanwhile
    SIGINT, SIGTERM and SIGHUP unwind (:mod:`tfgraph.interrupts`), so they leave nothing
    either; what a killed process (SIGKILL, out of memory) left is removed by the next call
    into the same directory (:func:`sweep_stale`).
    """
    out_dir = Path(out_dir)
    check_target(out_dir, marker, kind)
    parent = out_dir.resolve().parent
    created = [p for p in (parent, *parent.parents) if not p.exists()]  # like mkdir -p
    with unwinding():
        stage = None
        try:
            parent.mkdir(parents=True, exist_ok=True)
            sweep_stale(parent)
            with deferred():  # not a directory made and then forgotten
                stage = Path(
                    tempfile.mkdtemp(prefix=f".{out_dir.name}.tfgraph-{_owner()}-", dir=parent)
                )
            yield stage
            with deferred():  # not half a pair of renames
                _commit(stage, out_dir)
        except BaseException as exc:
            with deferred():  # not half removed
                if stage is not None:
                    shutil.rmtree(stage, ignore_errors=True)
                _remove_created(created)
            if isinstance(exc, OSError):
                raise write_error(out_dir, exc, kind) from exc
            raise


@contextlib.contextmanager
def scratch_directory(parent: Path, label: str) -> Iterator[Path]:
    """A hidden directory in ``parent`` for files a step needs on the side (``label``: what
    for, ``kv``), removed on the way out whatever happens. It is named for this process like a
    staging directory, so that the next export removes it if this process is killed."""
    path = None
    try:
        with deferred():
            path = Path(tempfile.mkdtemp(prefix=f".tfgraph-{label}-{_owner()}-", dir=parent))
        yield path
    finally:
        if path is not None:
            with deferred():
                shutil.rmtree(path, ignore_errors=True)


def _remove_created(created: list[Path]) -> None:
    for p in created:  # innermost first: leave the tree as it was
        with contextlib.suppress(OSError):
            p.rmdir()


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


def write_error(out_dir: Path, exc: OSError, kind: str = "artifact") -> TfgraphError:
    """One line for a failed write: what the system said and what to do."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.errno in _FULL:
        hint = "free some disk space or choose another -o"
    elif exc.errno in _DENIED:
        hint = "choose an output directory you can write (-o)"
    else:
        hint = "check the output directory or choose another -o"
    return TfgraphError(f"cannot write the {kind} '{out_dir}': {reason}; {hint}")


def _commit(stage: Path, out_dir: Path) -> None:
    os.chmod(stage, 0o755)  # mkdtemp makes it private
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.tfgraph-old-{_owner()}")
        os.replace(out_dir, old)
    try:
        os.replace(stage, out_dir)
    except BaseException:
        if old is not None:
            os.replace(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    logger.info("wrote %s", out_dir)


# What tfgraph leaves beside a target while it works, named for its owner: this host (a hash of
# its name, since processes on other hosts sharing the directory are not ours to judge) and
# this process.
_HOST_PID = r"(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)"
_OWNED = {
    "staging": re.compile(rf"^\.(?P<name>.+)\.tfgraph-{_HOST_PID}-[a-z0-9_]{{8}}$"),
    "moved aside": re.compile(rf"^\.(?P<name>.+)\.tfgraph-old-{_HOST_PID}$"),  # for the renames
    "scratch": re.compile(rf"^\.tfgraph-[a-z]+-{_HOST_PID}-[a-z0-9_]{{8}}$"),
}
# The same from tfgraph versions that did not name their process: whether one is still in use
# cannot be told, so they are reported, not removed.
_UNOWNED = re.compile(r"^\.(?:.+\.tfgraph-(?:[a-z0-9_]{8}|old-[0-9]+)|tfgraph-kv-[a-z0-9_]{8})$")


def _owner() -> str:
    return f"{_host()}-{os.getpid()}"


@functools.cache
def _host() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def sweep_stale(parent: Path) -> list[Path]:
    """Remove what tfgraph processes on this host that no longer run left in ``parent``
    (killed by SIGKILL, the out-of-memory killer, a power cut): staging and scratch directories
    are deleted; an artifact that was moved aside to be replaced goes back to its name if
    nothing took it. Nothing of a process still running, nothing not named as tfgraph names
    them, is touched. Returns the paths removed or restored."""
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(".")]
    except OSError:
        return []
    swept = []
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        kind, match = _owned(entry.name)
        if match is None:
            _report_unowned(entry)
            continue
        path = Path(entry.path)
        if _stale(match) and _sweep(path, match, moved_aside=kind == "moved aside"):
            swept.append(path)
    return swept


def _owned(name: str) -> tuple[str | None, re.Match | None]:
    for kind, pattern in _OWNED.items():
        match = pattern.match(name)
        if match is not None:
            return kind, match
    return None, None


def _report_unowned(entry: os.DirEntry) -> None:
    if _UNOWNED.match(entry.name):
        logger.warning(
            "%s was left by an earlier tfgraph version that does not name its process, so it "
            "is kept; remove it if no tfgraph export is running",
            entry.path,
        )


def _stale(match: re.Match) -> bool:
    return match["host"] == _host() and not _running(int(match["pid"]))


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists; True when that cannot be told without signalling it."""
    if pid == os.getpid() or os.name != "posix":
        return True
    try:
        os.kill(pid, 0)  # signal 0: no signal, only the check
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):  # another user's process, a pid out of range
        return True
    return True


def _sweep(path: Path, match: re.Match, moved_aside: bool) -> bool:
    pid = match["pid"]
    target = path.with_name(match["name"]) if moved_aside else None
    if target is not None and not os.path.lexists(target):
        with contextlib.suppress(OSError):
            os.replace(path, target)
            logger.warning(
                "restored %s: tfgraph process %s, which no longer runs, had moved it aside to "
                "replace it",
                target,
                pid,
            )
            return True
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        logger.warning("could not remove %s, left by tfgraph process %s", path, pid)
        return False
    logger.warning("removed %s, left by tfgraph process %s, which no longer runs", path, pid)
    return True


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
