"""Atomic artifact directories: everything is written into a hidden staging directory beside
the target and renamed into place only when complete, so a failure leaves nothing behind."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tfgraph.errors import TfgraphError

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
    :class:`TfgraphError` naming ``out_dir``; nothing is left behind either way.
    """
    out_dir = Path(out_dir)
    check_target(out_dir, marker, kind)
    parent = out_dir.resolve().parent
    created = [p for p in (parent, *parent.parents) if not p.exists()]  # like mkdir -p
    try:
        parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tfgraph-", dir=parent))
    except OSError as exc:
        _remove_created(created)
        raise write_error(out_dir, exc, kind) from exc
    try:
        yield stage
        _commit(stage, out_dir)
    except BaseException as exc:
        shutil.rmtree(stage, ignore_errors=True)
        _remove_created(created)
        if isinstance(exc, OSError):
            raise write_error(out_dir, exc, kind) from exc
        raise


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
        old = out_dir.with_name(f".{out_dir.name}.tfgraph-old-{os.getpid()}")
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


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
