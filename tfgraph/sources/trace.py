"""Tracing: ``nn.Module`` → torch.export → torch.onnx dynamo exporter → ``onnx_ir.Model``.

Batch and sequence dimensions stay dynamic and keep their names (``batch``, ``sequence``, ...).
The exporter's node metadata (``pkg.torch.onnx.name_scopes``: the PyTorch module path of every
node) is kept, so reports can map graph nodes back to modules (:func:`module_name`).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import re
import warnings

import onnx_ir as ir
import onnx_ir.passes.common as common
import torch
from onnxscript import rewriter

from tfgraph import contract
from tfgraph import onnxscript_private as private
from tfgraph.errors import TfgraphError, first_line
from tfgraph.passes.lazy_weights import fold_weight_transposes
from tfgraph.passes.provenance import module_name  # noqa: F401  (re-exported)
from tfgraph.passes.recognize.exact_no_op import exact
from tfgraph.sources import (
    block_indexer,
    complex_rotary,
    host_ranges,
    inference_trace,
    recurrent_kernels,
    recurrent_layers,
    replicate_layers,
    rg_lru,
    rwkv,
    sliding_chunks,
    xlstm,
)
from tfgraph.sources.model import ModelSource

logger = logging.getLogger(__name__)

DEFAULT_OPSET = 20
EXAMPLE_SHAPE = (2, 9)  # batch, sequence: ≥ 2 so torch.export does not specialize them


def trace(source: ModelSource, *, opset: int = DEFAULT_OPSET) -> ir.Model:
    """Export the source's module to an ``onnx_ir.Model`` with named dynamic axes."""
    logger.info("tracing %s (opset %d)", source.origin, opset)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    module = source.trace_module or source.module
    example = _example(source, module)
    model = _shortened_trace(source, module, example, opset)
    if model is None:
        model = _export(source, module, example, opset).model
    if source.binder is not None:  # weights traced on the meta device: bound lazily here
        source.binder.bind(model)  # parameters were uninitialized storage: the checkpoint's
        fold_weight_transposes(model)  # Linear's W.T, folded without reading W
    # The exporter's own optimize() is onnxscript's optimizer (constant folding, CSE, dead
    # code) plus, at opset 23, onnxscript's ONNX fusions (RMSNormalization, RotaryEmbedding,
    # GQA). Run only the former: recognition and lowering are our passes' job, with reports
    # per layer, and the fused RotaryEmbedding it makes does not run in ONNX Runtime 1.32.
    _optimize(model)
    _bounded_dims(model, source.info.get("max_positions"))
    model.producer_name = "tfgraph"
    contract.write_roles(model, source.roles())  # what each input and output is, from here on
    return model


def _example(source: ModelSource, module) -> tuple[tuple, dict, tuple | dict]:
    """(args, kwargs, dynamic shapes) to trace ``module`` with: the source's inputs at
    :data:`EXAMPLE_SHAPE`, bound as the source binds them. Inputs by keyword get their dynamic
    axes keyed as torch.export binds them (forward's parameter names; ``**kwargs`` nested)."""
    args, kwargs = source.arguments(source.inputs(*EXAMPLE_SHAPE))
    axes = {n: source.dynamic_axes.get(n, {}) for n in source.input_names}
    if not kwargs:
        return args, kwargs, tuple(axes.values())
    signature = inspect.signature(module.forward)
    dynamic = {}
    for name, value in signature.bind(*args, **kwargs).arguments.items():
        if signature.parameters[name].kind == inspect.Parameter.VAR_KEYWORD:
            dynamic[name] = {k: axes[k] for k in value}
        else:
            dynamic[name] = axes[name]
    return args, kwargs, dynamic


def export_program(source: ModelSource) -> None:
    """torch.export alone (non-strict, no ONNX translation) on the trace's example and dynamic
    axes: what :mod:`tfgraph.sources.axis_conflicts` re-runs, a fraction of a full trace, to
    read torch's guard log when the full trace failed."""
    module = source.trace_module or source.module
    args, kwargs, dynamic = _example(source, module)

    def dims(spec):  # {dim: "name"} → {dim: Dim.DYNAMIC}, through tuples and dicts of them
        if isinstance(spec, dict) and all(isinstance(k, int) for k in spec):
            return {k: torch.export.Dim.DYNAMIC for k in spec}
        if isinstance(spec, dict):
            return {k: dims(v) for k, v in spec.items()}
        return type(spec)(dims(v) for v in spec)

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.export.export(module, args, kwargs, dynamic_shapes=dims(dynamic), strict=False)


def _export(source: ModelSource, module, example, opset: int):
    args, kwargs, dynamic = example
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            recurrent_kernels.substituted(module) as taken,
            complex_rotary.substituted(module) as paired,
            recurrent_layers.substituted(module) as layers,
            host_ranges.substituted(module) as ranges,
            rg_lru.substituted(module) as scans,
            rwkv.substituted(module),
            xlstm.substituted(module),
            block_indexer.substituted(module),
            sliding_chunks.substituted(module, source.input_names),
            _without_value_checks(),
            inference_trace.for_inference(source),  # the layouts eager inference has
        ):
            warnings.simplefilter("ignore")
            if taken:
                source.info["recurrent_kernels"] = dict(taken)
            if paired:
                source.info["complex_rotary"] = paired
            if layers:
                source.info["recurrent_layers"] = layers
            if ranges:
                source.info["host_ranges"] = ranges
            if scans:
                source.info["rg_lru"] = scans
            return torch.onnx.export(
                module,
                args,
                kwargs=kwargs or None,
                dynamo=True,
                custom_translation_table=recurrent_kernels.translation_table(),
                dynamic_shapes=dynamic,
                input_names=list(source.input_names),
                output_names=list(source.output_names),
                opset_version=opset,
                optimize=False,  # see below: our passes do the fusions
                verbose=False,
                report=False,
            )
    except Exception as exc:
        raise TfgraphError(
            f"tracing {source.origin} failed: {first_line(exc, named=True, root=True)}"
        ) from exc


@contextlib.contextmanager
def _without_value_checks():
    """Checks on tensor values off while tracing, each with its library's own switch: Hugging
    Face's ``torch_compilable_check`` (SigLIP 2's "spatial shapes are positive"; traced, an
    ``aten._is_all_true`` assert, which has no ONNX translation and no place in a graph) and
    the argument validation of ``torch.distributions`` (BLT's ``Categorical(logits=…)``
    branches on whether the logits are finite: data-dependent)."""
    key = "TRANSFORMERS_DISABLE_TORCH_CHECK"
    before = os.environ.get(key)
    os.environ[key] = "1"
    validate = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(validate)
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _shortened_trace(source: ModelSource, module, example, opset: int) -> ir.Model | None:
    """The graph of ``module`` traced with its first layers only and the rest copied
    (:mod:`tfgraph.sources.replicate_layers`); ``None`` when that does not apply or does not
    prove itself (the full trace follows)."""
    found = replicate_layers.plan(module)
    if found is None:
        return None
    try:
        with replicate_layers.shortened(module, found):
            model = _export(source, module, example, opset).model
        replicate_layers.replicate(model, found)
    except (TfgraphError, replicate_layers.NotReplicable) as exc:
        logger.info("tracing every layer of %s: %s", found.path, first_line(exc))
        return None
    source.info["traced_layers"] = f"{replicate_layers.TRACED} of {found.count} in {found.path}"
    return model


_MIN_DIM = re.compile(r"^Min\((?:(\d+), (\w+)|(\w+), (\d+))\)$")


def _bounded_dims(model: ir.Model, max_positions: int | None) -> None:
    """Name ``Min(N, sequence)`` dims ``sequence`` when ``N`` is at least the model's
    position limit. A model that slices a buffer of its maximum length to the input's
    (GPT-Neo's causal mask ``bias[:, :, :T, :T]``) gets that dim from torch.export; within
    the limit it is the sequence itself, which later passes must see (the KV-cache pass finds
    a bias's query axis by it). Only annotations change, never the computation."""
    if not max_positions:
        return

    def simpler(dim):
        if not isinstance(dim, ir.SymbolicDim) or dim.value is None:
            return dim
        found = _MIN_DIM.match(dim.value)
        if found is None:
            return dim
        bound = int(found.group(1) or found.group(4))
        name = found.group(2) or found.group(3)
        return ir.SymbolicDim(name) if bound >= max_positions else dim

    for value in ir.traversal.RecursiveGraphIterator(model.graph):
        for out in value.outputs:
            if out.shape is not None and any(isinstance(d, ir.SymbolicDim) for d in out.shape):
                dims = [simpler(d) for d in out.shape]
                if dims != list(out.shape):
                    out.shape = ir.Shape(dims)


# onnxscript's default rewrite rules minus ``SlicesSplit``: its two-output pattern is matched
# by scanning the whole graph for every candidate, which made tracing quadratic in depth
# (measured, 48-layer gpt-tiny: 45 of the optimizer's 48 s were that matcher; optimize_ir took
# 1.8 / 5.2 / 18.8 s at 16 / 32 / 64 layers). Two Slices stay two Slices (RoPE's rotate_half).
# onnxscript's no-op rules are tolerant (x + 1e-12 → x): swapped for exact ones.
_REWRITE_RULES = exact([r for r in private.DEFAULT_REWRITE_RULES if r.name != "SlicesSplit"])


def _optimize(model: ir.Model) -> None:
    """``onnxscript.optimizer.optimize_ir`` (constant folding, basic rewrites, dead code, CSE)
    with the rule list above."""
    passes = ir.passes.Sequential(
        common.InlinePass(),
        ir.passes.PassManager(
            [
                private.FoldConstantsPass(
                    shape_inference=True,
                    input_size_limit=private.FOLD_INPUT_SIZE_LIMIT,
                    output_size_limit=private.FOLD_OUTPUT_SIZE_LIMIT,
                ),
                rewriter.RewritePass(_REWRITE_RULES),
                common.RemoveUnusedNodesPass(),
                common.RemoveUnusedFunctionsPass(),
                common.RemoveUnusedOpsetsPass(),
            ],
            steps=2,
            early_stop=True,
        ),
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
    )
    passes(model)


class TraceCache:
    """Traces of unchanged sources, by opset, for exporting one model to several targets (the
    fuzzer and the coverage run do): tracing is most of an export's time. Every :meth:`get`
    returns a fresh copy, since the passes rewrite the graph in place. A source whose module
    changes between exports must not go through the same cache. ``by_origin``: sources are the
    same when their origin (a checkpoint directory loaded twice) and attention implementation
    are, not only when they are one object (the coverage run loads each checkpoint per export).
    """

    def __init__(self, by_origin: bool = False) -> None:
        self._protos: dict[tuple, tuple[ModelSource, object]] = {}
        self.by_origin = by_origin
        self.hits = 0

    def get(self, source: ModelSource, opset: int, trace_fn=None) -> ir.Model:
        if self.by_origin:
            static = tuple(source.info.get("static_axes", {}).items())  # another graph
            key = (source.origin, source.info.get("attn_implementation"), static, opset)
        else:
            key = (id(source), opset)
        if key in self._protos:
            self.hits += 1
            logger.info("reusing the trace of %s at opset %d", source.origin, opset)
        else:
            model = (trace_fn or trace)(source, opset)
            # the source is held so that its id stays its own
            self._protos[key] = (source, ir.serde.serialize_model(model), _lazy_weights(model))
            return model
        _, proto, lazy = self._protos[key]
        copy = ir.serde.deserialize_model(proto)
        for name, tensor in lazy.items():  # a streamed checkpoint's weights: the lazy reads back
            copy.graph.initializers[name].const_value = tensor
        return copy


def _lazy_weights(model: ir.Model) -> dict:
    """The initializers read lazily from a streamed checkpoint, by name. A serialized copy
    holds their bytes but not what the weights stage reads off them (which checkpoint tensor
    each is: ``tfgraph.passes.lazy_weights``' metadata), so a copy gets them back: an int4
    export of a cached streamed trace found its weights' parameters again. The lazy tensors
    are read-only views of the checkpoint, safe to share between exports."""
    return {
        name: value.const_value
        for name, value in model.graph.initializers.items()
        if isinstance(value.const_value, ir.LazyTensor)
    }
