"""Static axes: named dynamic axes of a source kept at fixed sizes (``--static-axes``).

Some models fix a dimension in their own code (a relative-position table built through
``int(x.shape[1])`` and numpy, a mask built in a Python loop over the length): torch.export
then refuses to keep that axis dynamic. Exporting with the axis static traces, checks parity
and saves the graph at one size of it; the user chooses that (the trace error offers the
flag, :mod:`tfgraph.sources.tracing`), it is never done silently.

An axis is fixed through the argument of the source's input maker that sizes it (``batch``
or ``seq``: found by making inputs at two sizes of each), so every axis that argument sizes
is fixed with it. Its size: ``AXIS=SIZE``, else the user's example inputs' (a factory's or
``export((module, example_inputs), …)``), else the trace's example (``EXAMPLE_SHAPE``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import torch

from tfgraph.errors import TfgraphError
from tfgraph.sources.model import ModelSource

logger = logging.getLogger(__name__)


def _trace_example() -> tuple[int, int]:
    """The trace's (batch, sequence) example (imported late: the trace may import this)."""
    from tfgraph.sources.trace import EXAMPLE_SHAPE

    return EXAMPLE_SHAPE


_ARGUMENTS = ("batch", "seq")  # the input maker's size arguments, in order


def parse_static_axes(spec: str | Iterable[str] | None) -> tuple[str, ...]:
    """``"sequence"``, ``"batch,sequence=128"`` or a list of such as a tuple of ``AXIS`` /
    ``AXIS=SIZE`` entries; malformed ones refused in one line."""
    if not spec:
        return ()
    items = spec.split(",") if isinstance(spec, str) else [str(s) for s in spec]
    out = []
    for item in (i.strip() for i in items):
        name, eq, size = item.partition("=")
        if not name.strip() or (eq and not (size.strip().isdigit() and int(size) > 0)):
            raise TfgraphError(
                f"--static-axes: bad entry '{item}'; write AXIS or AXIS=SIZE (a positive "
                "integer), comma-separated: --static-axes sequence or batch=1,sequence"
            )
        out.append(f"{name.strip()}={int(size)}" if eq else name.strip())
    return tuple(out)


def dynamic_axis_names(source: ModelSource) -> list[str]:
    """The names of the source's dynamic axes, in the order its inputs first use them."""
    names: list[str] = []
    for axes in source.dynamic_axes.values():
        names += [a for a in axes.values() if a not in names]
    return names


def with_static_axes(
    source: ModelSource, axes: str | Iterable[str] | None, *, kv_cache: bool = False
) -> ModelSource:
    """``source`` with the dynamic axes ``axes`` (``AXIS`` / ``AXIS=SIZE`` entries, or a string
    of them) fixed: its input maker makes them at one size whatever it is asked for, they
    leave its dynamic axes (torch.export traces them static), and ``info["static_axes"]``
    records each fixed axis and its size (the report and the manifest carry it). The same
    source without axes. An unknown axis, or the sequence with ``kv_cache``, is refused."""
    wanted = dict(_entry(e) for e in parse_static_axes(axes))
    if not wanted:
        return source
    known = dynamic_axis_names(source)
    for name in wanted:
        if name not in known:
            raise TfgraphError(
                f"--static-axes: '{name}' is not a dynamic axis of {source.origin}; its "
                f"dynamic axes: {', '.join(known) or 'none'}"
            )
    drivers = _drivers(source)
    pinned: dict[str, int] = {}  # maker argument → the size it is held at
    for name, size in wanted.items():
        argument = drivers[name]
        if argument == "both":
            raise TfgraphError(
                f"--static-axes: '{name}' of {source.origin} grows with both the batch and the "
                "sequence; fix those instead (--static-axes batch,sequence)"
            )
        if argument is None:  # sized by neither argument: the trace's size, kept
            continue
        pinned.setdefault(argument, size or _example_size(source, argument))
    if kv_cache and "seq" in pinned:
        raise TfgraphError(
            "--static-axes with --kv-cache: a cached graph takes any number of new tokens, so "
            "its sequence cannot be static; export without --kv-cache, or fix only the batch"
        )
    fixed = {n for n in known if n in wanted or drivers.get(n) in pinned}
    make = _pinned_maker(source.make_inputs, pinned)
    fixed_source = dataclasses.replace(
        source,
        make_inputs=make,
        dynamic_axes={
            n: {d: a for d, a in dims.items() if a not in fixed}
            for n, dims in source.dynamic_axes.items()
        },
        info=dict(source.info),
    )
    fixed_source.info["static_axes"] = _sizes(source, fixed_source, fixed)
    # the --static-axes value that fixes the same sizes again (tfgraph parity's re-check)
    fixed_source.info["static_axes_flag"] = ",".join(
        f"{n}={pinned[drivers[n]]}" if drivers[n] in pinned else n for n in wanted
    )
    logger.warning(
        "%s: static axes %s (the graph takes these sizes only)",
        source.origin,
        ", ".join(f"{a}={s}" for a, s in fixed_source.info["static_axes"].items()),
    )
    return fixed_source


def fixes_sequence(source: ModelSource, axes: Iterable[str]) -> bool:
    """Whether fixing ``axes`` fixes the sequence length the inputs are made at."""
    drivers = _drivers(source)
    return any(drivers.get(a) in ("seq", "both") for a in axes)


def _entry(item: str) -> tuple[str, int | None]:
    name, _, size = item.partition("=")
    return name, int(size) if size else None


def _drivers(source: ModelSource) -> dict[str, str | None]:
    """Axis name → the maker argument (``batch`` / ``seq``) that sizes it, ``"both"``, or
    ``None`` (neither: its size does not follow them)."""
    batch, seq = _trace_example()
    base = _shapes(source, batch, seq)
    moved = {
        "batch": _shapes(source, batch + 1, seq),
        "seq": _shapes(source, batch, seq + 1),
    }
    drivers: dict[str, str] = {}
    for name in dynamic_axis_names(source):
        by = {
            argument
            for argument, shapes in moved.items()
            for n, dims in source.dynamic_axes.items()
            for d, a in dims.items()
            if a == name and n in base and shapes[n][d] != base[n][d]
        }
        drivers[name] = by.pop() if len(by) == 1 else ("both" if by else None)
    return drivers


def _shapes(source: ModelSource, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
    inputs = source.make_inputs(batch, seq, torch.Generator().manual_seed(0))
    return {n: tuple(v.shape) for n, v in inputs.items() if isinstance(v, torch.Tensor)}


def _example_size(source: ModelSource, argument: str) -> int:
    """The size an argument is held at without ``=SIZE``: the user's example inputs' (when the
    source was made from them), else the trace's example."""
    shape = source.info.get("example_shape") or _trace_example()
    return int(shape[_ARGUMENTS.index(argument)])


def _pinned_maker(make, pinned: dict[str, int]):
    def make_pinned(batch: int, seq: int, generator: torch.Generator):
        return make(pinned.get("batch", batch), pinned.get("seq", seq), generator)

    make_pinned.pinned = dict(pinned)  # read by parity_shapes
    return make_pinned


def parity_shapes(source: ModelSource, shapes) -> tuple:
    """``shapes`` ((batch, seq) pairs) as the source makes them: a fixed argument at its
    size, repeats dropped (parity's report then names the shapes that ran)."""
    pinned = getattr(source.make_inputs, "pinned", None)
    if not pinned:
        return shapes
    out: list[tuple[int, int]] = []
    for batch, seq in shapes:
        shape = (pinned.get("batch", batch), pinned.get("seq", seq))
        if shape not in out:
            out.append(shape)
    return tuple(out)


def _sizes(source: ModelSource, fixed_source: ModelSource, fixed: set[str]) -> dict[str, int]:
    """Each fixed axis and the size the fixed source makes it at."""
    shapes = _shapes(fixed_source, *_trace_example())
    sizes: dict[str, int] = {}
    for n, dims in source.dynamic_axes.items():
        for d, a in dims.items():
            if a in fixed and n in shapes and a not in sizes:
                sizes[a] = int(shapes[n][d])
    return {a: sizes[a] for a in dynamic_axis_names(source) if a in sizes}
