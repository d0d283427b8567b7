"""Model sources: a preset name, a ``package.module:function`` factory, or a local HF directory.

Every source becomes a :class:`ModelSource`: the eager module plus what tracing and parity need
(input names, dynamic axes, a generator of random inputs at a given batch and sequence length).

A module may describe its own inputs through the *tfgraph input protocol*: attributes
``input_names`` / ``output_names`` and methods ``example_inputs(batch, seq, generator)`` and
``dynamic_axes()`` (every zoo model does). Otherwise the inputs are inferred (see
:func:`from_module`).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree

from tfgraph.errors import TfgraphError, first_line
from tfgraph.sources.model import InputMaker, ModelSource, bind_inputs, max_positions
from tfgraph.sources.objects import from_hf_object, is_hf_model

logger = logging.getLogger(__name__)


def load_source(
    spec, *, trust_remote_code: bool = False, attn_implementation: str | None = None
) -> ModelSource:
    """Resolve a MODEL argument of the CLI: preset name, ``pkg.mod:fn`` or a directory (a
    string or a path); from Python also a model object (:mod:`tfgraph.sources.objects`).

    ``attn_implementation`` (``eager``, ``sdpa``) applies to Hugging Face models only;
    ``None`` keeps the library's default.
    """
    from tfgraph.models import PRESETS

    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        return from_object(spec, attn_implementation=attn_implementation)
    if spec in PRESETS:
        return _from_preset(spec)
    if os.path.isdir(spec):
        from tfgraph.sources.huggingface import from_hf_dir

        return from_hf_dir(
            Path(spec), trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
        )
    if ":" in spec and not os.path.exists(spec):
        return _from_factory(spec)
    if os.path.exists(spec):
        raise TfgraphError(
            f"'{spec}' is a file, not a model: give a preset name, a package.module:function "
            "factory, or a Hugging Face model directory"
        )
    if _HUB_ID.fullmatch(spec):
        local = spec.rpartition("/")[2]
        raise TfgraphError(
            f"no directory '{spec}' here; if it is a Hugging Face hub id, tfgraph reads local "
            f"files only: download it first (`hf download {spec} --local-dir {local}`), then "
            f"export {local}"
        )
    raise TfgraphError(
        f"unknown model '{spec}': not a preset (list them with `python -m tfgraph models`), "
        "not a package.module:function factory, not a directory"
    )


# a Hugging Face hub id: owner/name (letters, digits, '-', '_', '.'; at most 96 characters each)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


def from_object(obj, *, attn_implementation: str | None = None) -> ModelSource:
    """The source of a model object (from Python): a transformers ``PreTrainedModel`` through
    the Hugging Face source (:func:`tfgraph.sources.objects.from_hf_object`), an ``nn.Module``
    or ``(nn.Module, example_inputs)`` through :func:`from_module`."""
    example = None
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], nn.Module):
        obj, example = obj
    if not isinstance(obj, nn.Module):
        raise TfgraphError(
            f"cannot export a {type(obj).__name__}: give an nn.Module, (nn.Module, "
            "example_inputs), a transformers PreTrainedModel, or a MODEL string (preset, "
            "package.module:function, directory)"
        )
    if is_hf_model(obj):
        if example is not None:
            logger.info("%s: its inputs come from its config; the examples are not used",
                        type(obj).__name__)  # fmt: skip
        return from_hf_object(obj, attn_implementation)
    return from_module(obj, example, origin=f"module:{type(obj).__name__}")


def _from_preset(name: str) -> ModelSource:
    from tfgraph.models import build

    source = from_module(build(name), origin=f"preset:{name}")
    source.info["preset"] = name
    return source


def _from_factory(spec: str) -> ModelSource:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise TfgraphError(f"bad factory '{spec}': write it as package.module:function")
    try:
        mod = importlib.import_module(module_name)
    except Exception as exc:  # an import error in user code is still the user's input
        raise TfgraphError(
            f"cannot import '{module_name}' for factory '{spec}' ({type(exc).__name__}: {exc}); "
            "check the module is on PYTHONPATH"
        ) from exc
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise TfgraphError(f"'{module_name}' has no callable '{attr}' (factory '{spec}')")
    result = fn()
    example = None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        result, example = result
    if not isinstance(result, nn.Module):
        raise TfgraphError(
            f"factory '{spec}' returned {type(result).__name__}; it must return an nn.Module "
            "or (nn.Module, example_inputs)"
        )
    return from_module(result.eval(), example, origin=f"factory:{spec}")


def from_module(module: nn.Module, example_inputs=None, *, origin: str = "module") -> ModelSource:
    """Wrap any ``nn.Module``.

    1. A module that implements the tfgraph input protocol describes itself.
    2. With example inputs (a tensor, a tuple, or a dict keyed by forward argument names,
       each value bound to the parameter it names: by keyword when the keys skip or reorder
       forward's parameters; the graph's inputs are named by the keys): every input of
       rank ≥ 2 gets dynamic axes 0 = ``batch`` and 1 = ``sequence``; random inputs at
       other shapes keep the example's dtype and value range. A module that does not run
       with another size of dim 1 (an image's channels) keeps only ``batch`` dynamic.
    3. With nothing: a single ``input_ids`` input of (batch, sequence) token ids drawn from
       the vocabulary of the module's first ``nn.Embedding``.

    A transformers ``PreTrainedModel`` goes to the Hugging Face source instead
    (:mod:`tfgraph.sources.objects`): its inputs come from its config.
    """
    if is_hf_model(module):  # its forward returns a DynamicCache: the Hugging Face source
        return from_object(module if example_inputs is None else (module, example_inputs))
    module = module.eval()
    keyword, example_shape = False, None
    if example_inputs is None and all(
        hasattr(module, a) for a in ("input_names", "example_inputs", "dynamic_axes")
    ):
        names = tuple(module.input_names)
        make = module.example_inputs
        axes = module.dynamic_axes()
    else:
        names, make, axes, keyword = _infer_inputs(module, example_inputs, origin)
        example_shape = _example_shape(example_inputs)
    outputs = getattr(module, "output_names", None)
    if outputs is None:
        probe = make(2, 5, torch.Generator().manual_seed(0))
        args, kwargs = bind_inputs(names, probe, keyword)
        with torch.no_grad():
            flat, _ = _pytree.tree_flatten(module(*args, **kwargs))
        outputs = ("logits",) if len(flat) == 1 else tuple(f"output_{i}" for i in range(len(flat)))
    source = ModelSource(module, tuple(names), tuple(outputs), axes, make, origin)
    source.keyword_inputs = keyword
    if example_shape is not None:  # what static axes keep (tfgraph.sources.static_axes)
        source.info["example_shape"] = example_shape
    limit = max_positions(getattr(module, "config", None))
    if limit is not None:
        source.info["max_positions"] = limit
    return source


def _example_shape(example) -> list[int] | None:
    """(batch, sequence) of the first example input of rank ≥ 2 (the sizes a static axis
    keeps); ``None`` without one."""
    if isinstance(example, torch.Tensor):
        example = (example,)
    values = example.values() if isinstance(example, dict) else example or ()
    first = next((t for t in values if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    return None if first is None else [int(first.shape[0]), int(first.shape[1])]


def _infer_inputs(module: nn.Module, example, origin: str):
    """(names, make, axes, keyword) of a module without the input protocol."""
    signature = inspect.signature(module.forward)
    params = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if example is None:
        emb = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
        if emb is None or not params:
            raise TfgraphError(
                f"cannot tell the inputs of {origin}: it has no nn.Embedding; return "
                "(module, example_inputs) from the factory"
            )
        vocab = emb.num_embeddings
        name = params[0]

        def make_ids(batch, seq, generator):
            return {name: torch.randint(0, vocab, (batch, seq), generator=generator)}

        return (name,), make_ids, {name: {0: "batch", 1: "sequence"}}, False

    if isinstance(example, torch.Tensor):
        example = (example,)
    if isinstance(example, (tuple, list)):
        if len(example) > len(params):
            raise TfgraphError(f"{origin}: {len(example)} example inputs for forward({params})")
        example = dict(zip(params, example, strict=False))
    if not isinstance(example, dict) or not all(
        isinstance(v, torch.Tensor) for v in example.values()
    ):
        raise TfgraphError(f"{origin}: example inputs must be tensors, a tuple or a dict of them")
    names = tuple(example)
    keyword = _binds_by_keyword(signature, names, origin)
    make, axes = _like(example, sequence=True)
    try:
        _run(module, names, make, keyword)
    except Exception as exc:  # dim 1 is not a sequence (image channels, a fixed length …)
        make, axes = _like(example, sequence=False)
        try:
            _run(module, names, make, keyword)
        except Exception as again:
            raise TfgraphError(
                f"{origin} fails on inputs shaped like its examples "
                f"({first_line(again, named=True)}); check the example inputs, or give the "
                "module the tfgraph input protocol"
            ) from again
        logger.warning(
            "%s does not run with another size of dim 1 (%s): only the batch dim stays dynamic",
            origin,
            first_line(exc, named=True),
        )
    return names, make, axes, keyword


def _binds_by_keyword(signature: inspect.Signature, names: tuple[str, ...], origin: str) -> bool:
    """Whether example inputs named ``names`` (a dict's keys, in order) bind to forward by
    keyword: not when they are forward's first parameters in order (the same call by
    position). A key that is no parameter forward takes by name is refused, naming them."""
    parameters = signature.parameters.values()
    positional = [
        p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if list(names) == positional[: len(names)]:
        return False
    by_name = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    only_positional = {p.name for p in parameters if p.kind == p.POSITIONAL_ONLY}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters)
    for name in names:
        if name in by_name or (takes_any and name not in only_positional):
            continue
        listed = ", ".join(
            p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        )
        raise TfgraphError(
            f"{origin}: example input '{name}' is not a parameter forward takes by name "
            f"(forward({listed})); key the example inputs by forward's parameter names, or "
            "give them as a tuple in forward's order"
        )
    return True


def _run(module: nn.Module, names: tuple[str, ...], make: InputMaker, keyword: bool) -> None:
    args, kwargs = bind_inputs(names, make(2, 5, torch.Generator().manual_seed(0)), keyword)
    with torch.no_grad():
        module(*args, **kwargs)


def _like(example: dict[str, torch.Tensor], *, sequence: bool):
    """(make, axes) for inputs like ``example``: dim 0 is ``batch``; dim 1 of inputs of rank
    ≥ 2 is ``sequence`` when ``sequence``, else it keeps the example's size."""
    axes = {}
    for n, t in example.items():
        axes[n] = (
            ({0: "batch", 1: "sequence"} if sequence else {0: "batch"}) if t.dim() >= 2 else {}
        )

    def make_like(batch, seq, generator):
        out = {}
        for n, t in example.items():
            if t.dim() >= 2:
                shape = (batch, seq if sequence else t.shape[1], *t.shape[2:])
            else:
                shape = tuple(t.shape)
            if t.dtype == torch.bool:
                out[n] = torch.ones(shape, dtype=torch.bool)
            elif t.dtype.is_floating_point:
                out[n] = torch.randn(shape, generator=generator, dtype=t.dtype)
            else:
                lo, hi = int(t.min()), int(t.max())
                out[n] = torch.randint(lo, hi + 1, shape, generator=generator, dtype=t.dtype)
        return out

    return make_like, axes
