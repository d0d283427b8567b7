"""Give chosen submodules their own method for the span of a trace.

The trace-time substitutions (:mod:`.recurrent_layers`, :mod:`.rg_lru`, :mod:`.xlstm`,
:mod:`.block_indexer`) each replace one method of the layers they recognize with a version
torch.export can trace, and restore the class's method afterwards, so that eager runs (the
parity reference) keep the original."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

import torch


@contextlib.contextmanager
def instance_methods(
    module: torch.nn.Module,
    attr: str,
    applies: Callable[[torch.nn.Module], bool],
    method: Callable[[Callable], Callable],
) -> Iterator[list[torch.nn.Module]]:
    """Within the block, each submodule of ``module`` for which ``applies`` holds (and that has
    no instance ``attr`` of its own already) runs ``method(original bound attr)`` as its
    ``attr``; yields those submodules."""
    taken = []
    for sub in module.modules():
        if applies(sub) and attr not in vars(sub):
            setattr(sub, attr, types.MethodType(method(getattr(sub, attr)), sub))
            taken.append(sub)
    try:
        yield taken
    finally:
        for sub in taken:
            delattr(sub, attr)
