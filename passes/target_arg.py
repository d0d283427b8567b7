"""The target a lowering pass is built for is handed to it: passes sit below the targets
(a target picks the passes' builders), so they never look one up by name."""

from __future__ import annotations


def require_target(target):
    """``target`` when it is a target object; a name is refused with what to call instead."""
    if isinstance(target, str):
        raise TypeError(
            f"passes take a Target, not the name {target!r}: "
            f"pass tfgraph.exporters.targets.get_target({target!r})"
        )
    return target
