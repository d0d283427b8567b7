"""Host-side ranges of a traced length, traced as ``torch.arange``.

``torch.tensor(list(range(n)))`` builds a tensor from a Python list; when ``n`` is a traced
dim (a sequence length), ``range`` needs a concrete int, so torch.export specializes the dim
to the example's size and the export fails ("Found the following conflicts between
user-specified ranges and inferred ranges": ``inputs['input_ids'].shape[1]`` static). CPM-Ant
builds its left-padding mask so: ``torch.tensor(list(range(seqlen - prompt_length))[::-1])``.

While tracing, every function and method of the model's own Python modules whose code builds
such a tensor is recompiled from its source with the idiom stated as the same tensor computed
on the graph: ``torch.tensor(list(range(*a))[, **kw])`` → ``torch.arange(*a[, **kw])``, and
the reversed list (``[::-1]``) → ``torch.arange(*a[, **kw]).flip(0)``; both are int64, as the
list's tensor is. The rest of the code, its file and line numbers stay as they are; eager
PyTorch (the parity reference) runs the original. A function with decorators or a closure
(``super()``'s ``__class__`` cell) is left as is.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import logging
import sys
import textwrap
import types
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

_NAMES = frozenset({"tensor", "list", "range"})  # what a function that has the idiom names


def _range_args(node: ast.expr) -> tuple[list[ast.expr], bool] | None:
    """(``range``'s arguments, reversed) of ``list(range(…))`` or ``list(range(…))[::-1]``."""
    reverse = False
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Slice)
        and node.slice.lower is None
        and node.slice.upper is None
        and isinstance(node.slice.step, ast.UnaryOp)
        and isinstance(node.slice.step.op, ast.USub)
        and isinstance(node.slice.step.operand, ast.Constant)
        and node.slice.step.operand.value == 1
    ):
        node, reverse = node.value, True
    if not (_is_call(node, "list") and len(node.args) == 1 and not node.keywords):
        return None
    inner = node.args[0]
    if not (_is_call(inner, "range") and 1 <= len(inner.args) <= 3 and not inner.keywords):
        return None
    return inner.args, reverse


def _is_call(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


class _Rewrite(ast.NodeTransformer):
    def __init__(self) -> None:
        self.count = 0

    def visit_Call(self, node: ast.Call) -> ast.expr:
        self.generic_visit(node)
        func = node.func
        is_tensor = (
            isinstance(func, ast.Attribute)
            and func.attr == "tensor"
            and isinstance(func.value, ast.Name)
            and func.value.id == "torch"
        )
        found = _range_args(node.args[0]) if is_tensor and len(node.args) == 1 else None
        if found is None:
            return node
        args, reverse = found
        arange = ast.Attribute(value=func.value, attr="arange", ctx=ast.Load())
        out: ast.expr = ast.Call(func=arange, args=args, keywords=node.keywords)
        if reverse:
            flip = ast.Attribute(value=out, attr="flip", ctx=ast.Load())
            out = ast.Call(func=flip, args=[ast.Constant(0)], keywords=[])
        self.count += 1
        return ast.copy_location(out, node)


def rewritten(function: types.FunctionType) -> types.FunctionType | None:
    """``function`` with its host-side ranges computed by ``torch.arange``; ``None`` when it
    has none, or cannot be recompiled from its source."""
    code = function.__code__
    if not _NAMES <= set(code.co_names) or code.co_freevars:
        return None
    try:
        source = textwrap.dedent(inspect.getsource(function))
        filename = inspect.getsourcefile(function) or code.co_filename
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, ast.FunctionDef) or definition.decorator_list:
        return None
    rewrite = _Rewrite()
    tree = ast.fix_missing_locations(rewrite.visit(tree))
    if not rewrite.count:
        return None
    ast.increment_lineno(tree, code.co_firstlineno - 1)  # tracebacks name the original lines
    scope: dict = {}
    exec(compile(tree, filename, "exec"), function.__globals__, scope)  # noqa: S102
    copy = scope[definition.name]
    copy.__defaults__, copy.__kwdefaults__ = function.__defaults__, function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    return copy


def _owners(module: torch.nn.Module) -> list[object]:
    """The model's own Python modules and the classes of its submodules (not torch's)."""
    classes = {}
    for sub in module.modules():
        for cls in type(sub).__mro__:
            if cls.__module__ and not cls.__module__.startswith(("torch.", "builtins")):
                classes[id(cls)] = cls
    names = sorted({cls.__module__ for cls in classes.values()})
    namespaces = [sys.modules[n] for n in names if n in sys.modules]
    return [*namespaces, *classes.values()]


@contextlib.contextmanager
def substituted(module: torch.nn.Module) -> Iterator[int]:
    """Within the block, the functions and methods of ``module``'s own code that build a
    tensor from a host-side range compute it with ``torch.arange``; yields how many."""
    patched: list[tuple[object, str, object]] = []
    for owner in _owners(module):
        for attr, value in list(vars(owner).items()):
            if not isinstance(value, types.FunctionType):
                continue
            copy = rewritten(value)
            if copy is not None:
                patched.append((owner, attr, value))
                setattr(owner, attr, copy)
    if patched:
        names = ", ".join(v.__qualname__ for _, _, v in patched)
        logger.info("host-side ranges traced as torch.arange: %s", names)
    try:
        yield len(patched)
    finally:
        for owner, attr, value in reversed(patched):
            setattr(owner, attr, value)
