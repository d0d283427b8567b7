"""The targets: one object per backend (:class:`~tfgraph.exporters.target.Target`), one folder each.

Every ``target*`` module of a folder of :mod:`tfgraph.exporters` (``ort/target.py``,
``ort/target_cuda.py``, ``onnx/target.py``, ``tensorrt/target.py``) is imported on first use
and registers its targets with :func:`register`; adding a target is adding a folder with its
``target.py``, its passes beside it. ``get_target("tensorrt@10.14")`` builds a
parameterized target from its factory (``register_factory``). ``python -m tfgraph targets``
lists them.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

from tfgraph.exporters.target import FUSION_KINDS, SessionSettings, Target

_TARGETS: dict[str, Target] = {}
_FACTORIES: dict[str, Callable[[tuple[int, ...]], Target]] = {}
_loaded = False


def register(target: Target) -> Target:
    """Add ``target`` under its name (replacing one of the same name)."""
    _TARGETS[target.name] = target
    return target


def register_factory(name: str, factory: Callable[[tuple[int, ...]], Target]) -> None:
    """``name@X.Y`` builds ``factory((X, Y))``."""
    _FACTORIES[name] = factory


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    import tfgraph.exporters as package

    folders = [i.name for i in pkgutil.iter_modules(package.__path__) if i.ispkg]
    for folder in sorted(folders, key=lambda n: (n != "ort", n)):  # ort first
        found = importlib.import_module(f"{package.__name__}.{folder}")
        for info in sorted(pkgutil.iter_modules(found.__path__), key=lambda i: i.name):
            if info.name.startswith("target"):
                importlib.import_module(f"{found.__name__}.{info.name}")


def targets() -> dict[str, Target]:
    """The registered targets by name, built-in ones first."""
    _load()
    return dict(_TARGETS)


def target_names() -> list[str]:
    return list(targets())


def get_target(target: Target | str, *, error: type[Exception] | None = None) -> Target:
    """The target named ``target`` (``name`` or ``name@version``); a :class:`Target` is
    returned as is. Unknown names raise ``error`` (default :class:`tfgraph.TfgraphError`)."""
    if isinstance(target, Target):
        return target
    _load()
    name, _, version = str(target).partition("@")
    if version and name in _FACTORIES:
        try:
            parsed = tuple(int(p) for p in version.split("."))
        except ValueError:
            parsed = ()
        if parsed:
            return _FACTORIES[name](parsed)
    if not version and name in _TARGETS:
        return _TARGETS[name]
    if error is None:
        from tfgraph.errors import TfgraphError as error  # noqa: N813
    versioned = ", ".join(f"{n}@X.Y" for n in _FACTORIES)
    raise error(
        f"unknown target '{target}': choose one of {', '.join(_TARGETS)}"
        + (f" (or {versioned})" if versioned else "")
    )


def all_fused_ops() -> dict[str, frozenset]:
    """Every registered target's fused ops, per kind: for graphs whose target is unknown."""
    out: dict[str, frozenset] = {k: frozenset() for k in FUSION_KINDS}
    for target in targets().values():
        for kind in FUSION_KINDS:
            out[kind] |= target.fused(kind)
    return out


def all_nonstandard_default_ops() -> frozenset:
    ops: frozenset = frozenset()
    for target in targets().values():
        ops |= target.nonstandard_default_ops
    return ops


__all__ = [
    "SessionSettings",
    "Target",
    "all_fused_ops",
    "all_nonstandard_default_ops",
    "get_target",
    "register",
    "register_factory",
    "target_names",
    "targets",
]
