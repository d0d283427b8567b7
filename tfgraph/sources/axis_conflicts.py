"""A dynamic axis that the model's own code fixes, explained in one line.

A relative-position helper that builds its table through ``int(x.shape[1])`` and numpy, or a
mask built in a Python loop over the length, turns the length into a Python int: torch.export
traces that size as a constant and then refuses the dynamic axis ("Found the following
conflicts between user-specified ranges and inferred ranges from model tracing:", its lines
naming ``inputs['x'].shape[1]`` and the size). :func:`explained` names the input, the dim,
its dynamic axis, the size and, where torch's guard log shows it, the model's line that
fixed it, and offers the flag that exports with the axis static
(:mod:`tfgraph.sources.static_axes`). It is offered, never applied: the graph would then take
that size only, which is the user's choice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tfgraph.errors import TfgraphError
from tfgraph.sources.model import ModelSource
from tfgraph.sources.static_axes import fixes_sequence

logger = logging.getLogger(__name__)

HEADER = "Found the following conflicts between user-specified ranges"
# "- Received user-specified dim hint Dim.DYNAMIC(…), but tracing inferred a static shape of 9
# for dimension inputs['x'].shape[1]." (or "… 0/1 specialized due to hint of 1 for dimension …")
_VIOLATION = re.compile(
    r"(?:static shape of|hint of) (-?\d+) for dimension inputs(\S*?)\.shape\[(\d+)\]"
)
_KEY = re.compile(r"\[(?:'([^']*)'|(\d+))\]")
_GUARD_LOGGER = "torch.fx.experimental.symbolic_shapes"


@dataclass(frozen=True)
class FixedDim:
    """One input dim torch.export found fixed: the input, the dim, its axis name, the size."""

    input: str
    dim: int
    axis: str | None
    size: int

    def describe(self) -> str:
        axis = f" (axis '{self.axis}')" if self.axis else ""
        return f"input '{self.input}' dim {self.dim}{axis} to {self.size}"


def _conflict_text(exc: BaseException) -> str:
    """The message of torch.export's range-conflict error among ``exc``'s causes ("" when
    none): the innermost (the wrappers above it keep its first line only)."""
    seen: set[int] = set()
    found = ""
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if HEADER in str(exc):
            found = str(exc)
        exc = exc.__cause__ or exc.__context__
    return found


def is_conflict(exc: BaseException) -> bool:
    """Whether torch.export's range-conflict error is among ``exc``'s causes."""
    return bool(_conflict_text(exc))


def fixed_dims(source: ModelSource, exc: BaseException) -> list[FixedDim]:
    """The dims the conflict error names, each mapped to the source's input and axis."""
    found = []
    for size, keypath, dim in _VIOLATION.findall(_conflict_text(exc)):
        name = _input_name(source, keypath)
        if name is None:
            continue
        axis = source.dynamic_axes.get(name, {}).get(int(dim))
        fixed = FixedDim(name, int(dim), axis, int(size))
        if fixed not in found:
            found.append(fixed)
    return found


def _input_name(source: ModelSource, keypath: str) -> str | None:
    """The input a torch.export key path (``['x']``, ``[0]``, ``['kwargs']['mask']``) names:
    its last key that is an input name, else its last index into the inputs."""
    keys = _KEY.findall(keypath)
    for text, _ in reversed(keys):
        if text in source.input_names:
            return text
    indices = [int(i) for _, i in keys if i]
    if indices and indices[-1] < len(source.input_names):
        return source.input_names[indices[-1]]
    return None


@contextlib.contextmanager
def guards_recorded() -> Iterator[list[tuple[str, traceback.FrameSummary]]]:
    """Within the block, torch's shape guards as they are added: (expression, the innermost
    frame outside torch that added it). Its INFO log is on only here: it costs a stack walk
    per guard."""
    found: list[tuple[str, traceback.FrameSummary]] = []
    guard_log = logging.getLogger(_GUARD_LOGGER)

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            args = record.args if isinstance(record.args, tuple) else ()
            if "[guard added]" not in str(record.msg) or len(args) < 3:
                return
            frame = getattr(args[2], "framework_loc", None)
            if isinstance(frame, traceback.FrameSummary):
                found.append((str(args[1]), frame))

    # torch's own handler sits on this logger (torch._logging): set aside, or its INFO lines
    # would reach the terminal
    level, propagate, handlers = guard_log.level, guard_log.propagate, guard_log.handlers
    guard_log.handlers = [Recorder(logging.INFO)]
    guard_log.setLevel(logging.INFO)
    guard_log.propagate = False
    try:
        yield found
    finally:
        guard_log.handlers = handlers
        guard_log.setLevel(level)
        guard_log.propagate = propagate


def site(guards: list[tuple[str, traceback.FrameSummary]], size: int) -> str | None:
    """``file:line (`code`)`` of the first guard fixing a symbol to ``size`` outside torch."""
    fixing = re.compile(rf"^Eq\((?:s\d+, {size}|{size}, s\d+)\)$")
    torch_dir = os.path.dirname(torch.__file__)
    for expression, frame in guards:
        if fixing.match(expression) and not frame.filename.startswith(torch_dir):
            code = (frame.line or "").strip()
            where = f"{Path(frame.filename).name}:{frame.lineno}"
            return f"{where} (`{code}`)" if code else where
    return None


def explained(
    source: ModelSource,
    exc: BaseException,
    retrace: Callable[[], object],
    kv_cache: bool = False,
) -> TfgraphError | None:
    """The one-line error for a range conflict: the fixed dims, the model's line that fixed
    them (``retrace`` is run once more with torch's guard log recorded), and the
    ``--static-axes`` flag that exports with them static (with ``kv_cache``, without the
    cache when the sequence is among them). When it names no input of the source: torch's
    first conflict line; ``None`` when it has none."""
    fixed = fixed_dims(source, exc)
    if not fixed:  # no input named: torch's first conflict line, not only its header
        lines = [ln[2:] for ln in _conflict_text(exc).splitlines() if ln.startswith("- ")]
        if not lines:
            return None
        return TfgraphError(
            f"tracing {source.origin} failed: torch.export found a dimension the model's code "
            f"fixes ({lines[0]}); compute that size with tensor ops in the model"
        )
    with guards_recorded() as guards:
        try:
            retrace()
        except Exception:  # noqa: BLE001 - it fails again: only its guards are wanted
            pass
    where = site(guards, fixed[0].size)
    axes = list(dict.fromkeys(f.axis for f in fixed if f.axis))
    at = f" at {where}" if where else ""
    what = ", ".join(f.describe() for f in fixed)
    if axes:
        flag = ",".join(axes)
        cache = " without --kv-cache and" if kv_cache and fixes_sequence(source, axes) else ""
        todo = (
            f're-run{cache} with --static-axes {flag} (from Python: static_axes="{flag}"; the '
            "graph then takes the example inputs' size only), or compute that size with tensor "
            "ops in the model"
        )
    else:
        todo = "compute that size with tensor ops in the model"
    return TfgraphError(
        f"tracing {source.origin} failed: the model's code fixes {what}{at}, so it cannot stay "
        f"dynamic; {todo}"
    )
