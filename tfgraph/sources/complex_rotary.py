"""Complex-valued rotary embeddings traced as real pairs.

Llama 4 and DeepSeek-V2 (and code written after Meta's original LLaMA) rotate queries and keys
as complex numbers: ``freqs_cis = torch.polar(ones, angles)`` in the rotary module, then
``view_as_real(view_as_complex(x.reshape(..., -1, 2)) * freqs_cis)`` in the attention. The
torch.onnx exporter has no complex ``mul`` or ``unsqueeze`` (ONNX has no complex type), so the
trace fails at the first of them.

While tracing, every function and every module ``forward`` of the model's own Python modules
whose code calls ``torch.polar``, ``torch.view_as_complex`` or ``torch.view_as_real`` runs with
a ``torch`` in which those three make and unmake a :class:`Pair`: the real and imaginary parts
as a trailing axis of 2, the layout ``view_as_real`` gives. A pair multiplies as a complex
number, and indexes, unsqueezes and moves like the complex tensor it stands for, so the model's
own code (its broadcasting, its layouts) runs unchanged; the graph gets the real arithmetic
``(a·c − b·d, a·d + b·c)``, which :mod:`tfgraph.exporters.ort.fold_rotary` sees like any rotary
embedding. What a pair cannot do raises :class:`ComplexTraceError` naming the operation, and
the trace fails with it. Eager PyTorch (the parity reference) runs the original code.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import types
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

COMPLEX_CALLS = frozenset({"polar", "view_as_complex", "view_as_real"})


class ComplexTraceError(TypeError):
    """A complex operation a real pair does not implement."""


class Pair:
    """A complex tensor as its real view ``t`` (shape ``(*shape, 2)``)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    @property
    def shape(self) -> torch.Size:
        return self.t.shape[:-1]

    def dim(self) -> int:
        return self.t.dim() - 1

    @property
    def ndim(self) -> int:
        return self.t.dim() - 1

    @property
    def device(self) -> torch.device:
        return self.t.device

    def __mul__(self, other) -> Pair:
        if isinstance(other, Pair):
            a, b = self.t[..., 0], self.t[..., 1]
            c, d = other.t[..., 0], other.t[..., 1]
            return Pair(torch.stack([a * c - b * d, a * d + b * c], dim=-1))
        if isinstance(other, torch.Tensor):
            if other.is_complex():
                return self * Pair(torch.view_as_real(other))
            return Pair(self.t * other.unsqueeze(-1))
        if isinstance(other, int | float):
            return Pair(self.t * other)
        raise ComplexTraceError(f"complex * {type(other).__name__} is not supported")

    __rmul__ = __mul__

    def __getitem__(self, index) -> Pair:
        index = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis for i in index):  # the pair axis stays last
            index = (*index, slice(None))
        return Pair(self.t[index])

    def unsqueeze(self, dim: int) -> Pair:
        return Pair(self.t.unsqueeze(dim if dim >= 0 else dim - 1))

    def to(self, *args, **kwargs) -> Pair:
        """Device moves apply; a dtype (complex64 …) is the pair's own float already."""
        kwargs.pop("dtype", None)
        args = tuple(a for a in args if not isinstance(a, torch.dtype))
        return Pair(self.t.to(*args, **kwargs)) if args or kwargs else self

    def contiguous(self) -> Pair:
        return self

    def view(self, *shape) -> Pair:
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape
        return Pair(self.t.reshape(*shape, 2))

    reshape = view

    def __getattr__(self, name: str):
        raise ComplexTraceError(
            f"complex tensor .{name} is not supported while tracing (complex rotary embeddings "
            "are traced as real pairs; see tfgraph.sources.complex_rotary)"
        )


def _polar(abs: torch.Tensor, angle: torch.Tensor) -> Pair:
    return Pair(torch.stack([abs * torch.cos(angle), abs * torch.sin(angle)], dim=-1))


def _view_as_complex(x: torch.Tensor) -> Pair:
    if x.shape[-1] != 2:
        raise ComplexTraceError(f"view_as_complex of a tensor whose last axis is {x.shape[-1]}")
    return Pair(x)


def _view_as_real(x) -> torch.Tensor:
    return x.t if isinstance(x, Pair) else torch.view_as_real(x)


class _Torch(types.ModuleType):
    """``torch`` with the three complex calls making and unmaking pairs."""

    polar = staticmethod(_polar)
    view_as_complex = staticmethod(_view_as_complex)
    view_as_real = staticmethod(_view_as_real)

    def __getattr__(self, name: str):
        return getattr(torch, name)


_TORCH = _Torch("torch")


def _uses_complex(function) -> bool:
    code = getattr(function, "__code__", None)
    return code is not None and bool(COMPLEX_CALLS & set(code.co_names))


def _with_pairs(function):
    """``function`` with ``torch`` bound to the pair-making one (its other globals shared)."""
    scope = dict(function.__globals__)
    scope["torch"] = _TORCH
    copy = types.FunctionType(
        function.__code__, scope, function.__name__, function.__defaults__, function.__closure__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


@contextlib.contextmanager
def substituted(module: torch.nn.Module) -> Iterator[int]:
    """Within the block, the complex-using functions and forwards of ``module``'s own modules
    compute with pairs; yields how many were taken."""
    patched: list[tuple[object, str, object]] = []
    for name in sorted({type(m).__module__ for m in module.modules()}):
        namespace = sys.modules.get(name)
        if namespace is None or name.startswith("torch."):
            continue
        for attr, value in list(vars(namespace).items()):
            if isinstance(value, types.FunctionType) and _uses_complex(value):
                patched.append((namespace, attr, value))
                setattr(namespace, attr, _with_pairs(value))
    forwards = []
    for sub in module.modules():
        forward = inspect.unwrap(type(sub).forward)
        if not _uses_complex(forward):
            continue
        if "dynamic" in str(getattr(sub, "rope_type", "default")):
            continue  # its rope update wraps the forward: left as is (the trace then fails)
        sub.forward = types.MethodType(_with_pairs(forward), sub)
        forwards.append(sub)
    taken = len(patched) + len(forwards)
    if taken:
        logger.info("complex rotary code traced as real pairs: %d functions", taken)
    try:
        yield taken
    finally:
        for namespace, attr, value in reversed(patched):
            setattr(namespace, attr, value)
        for sub in forwards:
            del sub.forward
