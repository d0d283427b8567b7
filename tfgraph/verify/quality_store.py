"""The windows a quality measurement cuts a text into, how many go through a model at once,
and where the artifact's logits wait for the fp32 reference's (:mod:`tfgraph.verify.quality`).

The artifact runs first and its session is released before the fp32 model loads, so its
logits of the whole text are kept: ``(tokens - 1, vocab)`` float32, in memory up to
:data:`IN_MEMORY_BYTES`, else in a file in a temporary directory removed afterwards, written
and read a window at a time with plain file I/O (not mapped: its pages never count in the
process's resident memory; a 7B model's 32k vocabulary over a 100k-token text is 13 GB).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

IN_MEMORY_BYTES = 256 << 20


def windows(tokens: int, size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` input spans of ``size`` tokens over ``tokens`` ids, as
    :func:`tfgraph.tools.train_reference.perplexity` cuts them: positions ``start:stop``
    predict ids ``start + 1 : stop + 1``; the last span is shorter when the text ends."""
    return [(a, min(a + size, tokens - 1)) for a in range(0, tokens - 1, size)]


def batches(spans, vocab: int, budget: int, cap: int | None):
    """``spans`` in groups whose logits (the group's longest span ``× vocab`` float32 per
    window: shorter ones are padded, :func:`stacked`) stay within ``budget`` bytes together
    (one window at least), at most ``cap`` windows. The text's shorter last window joins the
    group before it: a 7B reference reads its weights once per group."""
    group: list[tuple[int, int]] = []
    longest = 0
    for span in spans:
        size = max(longest, span[1] - span[0])
        most = max(1, budget // max(1, size * vocab * 4))
        if cap is not None:
            most = min(most, cap)
        if group and len(group) + 1 > most:
            yield group
            group, size = [], span[1] - span[0]
        group.append(span)
        longest = size
    if group:
        yield group


def stacked(ids: np.ndarray, group) -> np.ndarray:
    """The group's windows as one ``(batch, longest)`` array, a shorter window padded at its
    end with its own last token: in a causal decoder nothing after a position changes its
    logits, and only the first ``stop - start`` positions of each row are read."""
    longest = max(b - a for a, b in group)
    rows = [np.pad(ids[a:b], (0, longest - (b - a)), mode="edge") for a, b in group]
    return np.stack(rows)


class LogitStore:
    """Rows ``0 .. positions-1`` of float32 logits (row ``t``: the prediction of token
    ``t + 1``), allocated at the first :meth:`put` once the vocabulary is known; a context
    manager that removes its temporary directory on exit."""

    def __init__(self, positions: int, vocab_hint: int = 1 << 17) -> None:
        self.positions = positions
        self.vocab_hint = vocab_hint  # batches are sized by it before the first logits come
        self.vocab: int | None = None
        self._rows: np.ndarray | None = None
        self._file = None  # the rows on disk, when too large for memory
        self._tmp: Path | None = None

    def __enter__(self) -> LogitStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def put(self, start: int, logits: np.ndarray) -> None:
        """``logits`` ``(T, vocab)``: rows ``start : start + T``."""
        if self.vocab is None:
            self._allocate(logits.shape[-1])
        if self._file is None:
            self._rows[start : start + len(logits)] = logits
            return
        self._file.seek(4 * start * self.vocab)
        self._file.write(np.ascontiguousarray(logits, np.float32).tobytes())

    def get(self, start: int, count: int) -> np.ndarray:
        """Rows ``start : start + count`` (float32, read from disk when kept there)."""
        if self._file is None:
            return self._rows[start : start + count]
        self._file.seek(4 * start * self.vocab)
        data = self._file.read(4 * count * self.vocab)
        return np.frombuffer(data, np.float32).reshape(count, self.vocab)

    def _allocate(self, vocab: int) -> None:
        self.vocab = self.vocab_hint = vocab
        size = 4 * self.positions * vocab
        if size <= IN_MEMORY_BYTES:
            self._rows = np.empty((self.positions, vocab), np.float32)
            return
        self._tmp = Path(tempfile.mkdtemp(prefix="tfgraph-quality-"))
        logger.info("quality: the artifact's logits (%.0f MiB) in %s", size / (1 << 20), self._tmp)
        self._file = open(self._tmp / "logits.f32", "w+b")  # noqa: SIM115 (closed in close())

    def close(self) -> None:
        """Drop the rows and remove the temporary directory (if any)."""
        self._rows = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
