"""Export precision: fp32 islands chosen by measurement, and what passing means in fp16.

**Islands** (:func:`measure_islands`). The lowered fp32 graph runs in ONNX Runtime on the
parity inputs with every intermediate value exposed. Then:

1. *Overflow*: a value whose largest magnitude exceeds :data:`OVERFLOW_LIMIT` (fp16's 65504
   with 4× headroom, since parity inputs are not every input) keeps its producer and every
   node reading it in fp32. Mask sentinels (|x| ≥ :data:`SENTINEL`, ``finfo.min`` and
   ``-inf``) are not values: they saturate to the lowest fp16 harmlessly. The first such value
   in graph order is reported with its layer: where the model leaves fp16's range.
2. *Index arithmetic*: float math that ends in a Cast to integers stays fp32 (a rounding
   there moves an index; T5's log-spaced buckets); so does a standard op whose schema has no
   such type at the graph's opset (``Einsum`` has no bf16 at opset 23).
3. *Error*: the graph as a device in the precision runs it (:func:`emulate`: every value a
   node outside the islands produces rounded to the precision, computation inside a node in
   fp32) on the same inputs. A node whose output strays from the fp32 value by more than
   :data:`ERROR_BUDGET` (10 units of the precision) of that value's scale while every float
   input it reads stays within the budget introduced the error (a cancellation, a ``Cos`` of
   a rounded angle): it joins the islands. An island that still strays with exact-enough
   inputs needs them exact: their producers join too. Repeat until nothing strays, at most
   :data:`MAX_ROUNDS` times. A kernel that writes the KV cache in place cannot be an island.

bf16 keeps fp32's exponent, so step 1 does not apply to it; steps 2 and 3 do (ONNX Runtime
runs the emulation: an fp32 graph with Cast pairs, which it has for bf16).

**Passing** (:func:`judge`). An export in precision p passes an output when its error against
fp32 eager is at most :data:`ERROR_FACTOR` times eager PyTorch's own error in p (the module
converted with ``.to(p)``) against fp32 eager, plus :data:`FLOOR_ULPS` units of p at the
output's scale. Both errors are reported per output. When eager itself overflows in p (inf or
NaN), the export passes within :data:`ERROR_BUDGET` of the output's scale.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common
import torch

from tfgraph import contract
from tfgraph.passes.lower.convert_precision import FP16_MAX, ConvertPrecisionPass, fill_float_types
from tfgraph.passes.provenance import layer_name

logger = logging.getLogger(__name__)

LOW_TYPES = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}
TORCH_TYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
PRECISIONS = ("fp32", *LOW_TYPES)
OVERFLOW_LIMIT = FP16_MAX / 4
SENTINEL = 1e30
# of a value's scale (max |x|): 10 units of the precision at scale 1 (fp16 ~1e-2, bf16 ~8e-2)
ERROR_UNITS = 10
MAX_ROUNDS = 6
# passing: error ≤ ERROR_FACTOR · eager's own error in the precision + FLOOR_ULPS units
ERROR_FACTOR = 4.0
FLOOR_ULPS = 4
UNIT = {"fp16": 2.0**-10, "bf16": 2.0**-7}  # spacing of numbers in [1, 2)
ERROR_BUDGET = {p: ERROR_UNITS * u for p, u in UNIT.items()}


def rule(precision: str) -> dict:
    """The passing rule of an export in ``precision``, for reports."""
    return {
        "precision": precision,
        "factor": ERROR_FACTOR,
        "floor_ulps": FLOOR_ULPS,
        "rule": f"max|export - fp32 eager| <= {ERROR_FACTOR:g} x max|{precision} eager - fp32 "
        f"eager| + {FLOOR_ULPS} {precision} units at the output's scale",
    }


@dataclass
class Island:
    node: str
    op: str
    module: str
    reason: str

    def as_dict(self) -> dict:
        return {"node": self.node, "op": self.op, "module": self.module, "reason": self.reason}


@dataclass
class IslandReport:
    keep: set[str]
    islands: list[Island]
    first_overflow: dict | None
    rounds: int
    unresolved: list[dict]
    budget: float

    def as_dict(self) -> dict:
        return {
            "islands": [i.as_dict() for i in self.islands],
            "first_overflow": self.first_overflow,
            "rounds": self.rounds,
            "unresolved": self.unresolved,
            "overflow_limit": OVERFLOW_LIMIT,
            "error_budget": self.budget,
        }


def copy_model(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


def _float_values(model: ir.Model) -> list[str]:
    """Names of the fp32 values nodes compute, in graph order."""
    return [
        out.name
        for node in model.graph
        for out in node.outputs
        if out.dtype == ir.DataType.FLOAT and out.name
    ]


def run_exposed(model: ir.Model, names: list[str], feeds: list[dict]) -> list[dict]:
    """Run a copy of ``model`` with ``names`` (node outputs) exposed as graph outputs; one
    ``{name: array}`` per feed."""
    from tfgraph.passes.pipeline.run import run_in_ort

    exposed = copy_model(model)
    present = {v.name for v in exposed.graph.outputs}
    values = {out.name: out for node in exposed.graph for out in node.outputs}
    for name in names:
        if name not in present and name in values:
            exposed.graph.outputs.append(values[name])
    return run_in_ort(exposed, feeds)


def _round(array: np.ndarray, low: ir.DataType) -> np.ndarray:
    """fp32 values as ``low`` stores them (fp16 clipped to its finite range), back in fp32."""
    if low == ir.DataType.FLOAT16:
        return np.clip(array, -FP16_MAX, FP16_MAX).astype(np.float16).astype(np.float32)
    import ml_dtypes

    return array.astype(ml_dtypes.bfloat16).astype(np.float32)


def emulate(model: ir.Model, low: ir.DataType, keep: frozenset[str]) -> ir.Model:
    """A copy of the fp32 ``model`` that computes what the graph converted to ``low`` outside
    the ``keep`` islands computes on a device that stores ``low`` between nodes and computes
    inside a node in fp32 (as fp16 GPU kernels accumulate): every value a node outside the
    islands produces is rounded through a ``Cast`` pair, and so are the constants it reads.

    Why not run the converted graph: ONNX Runtime's CPU provider runs ops that lack fp16
    kernels in fp32 through Casts it inserts, and drops the Cast pair between two such ops, so
    a chain of them rounds only at its end (measured: fp16 ``(x + 3000) − 3000`` came back
    exact); explicit Cast pairs in an fp32 graph are kept, and it has no bf16 kernels at all.
    """
    copy = copy_model(model)
    graph = copy.graph
    island = keep
    for value in graph.initializers.values():
        users = [u.node for u in value.uses()]
        if value.dtype == ir.DataType.FLOAT and any(u.name not in island for u in users):
            value.const_value = ir.tensor(_round(value.const_value.numpy(), low))
    outputs = set(graph.outputs)
    for node in list(graph):
        if node.name in island:
            continue
        if node.op_type == "Constant":
            users = [u.node for u in node.outputs[0].uses()]
            tensor = node.attributes.get_tensor("value")
            if users and all(u.name in island for u in users):
                continue  # read by islands only: stays fp32 (ConvertPrecisionPass case 3)
            if tensor is not None and tensor.dtype == ir.DataType.FLOAT:
                rounded = ir.tensor(_round(tensor.numpy(), low))
                node.attributes["value"] = ir.AttrTensor("value", rounded)
            continue
        for value in node.outputs:
            if value.dtype != ir.DataType.FLOAT or (not value.uses() and value not in outputs):
                continue
            name = value.name
            value.name = f"{name}__raw"
            down = ir.node("Cast", [value], attributes={"to": low})
            up = ir.node("Cast", [down.outputs[0]], attributes={"to": ir.DataType.FLOAT})
            stored = up.outputs[0]
            stored.name, stored.dtype, stored.shape = name, ir.DataType.FLOAT, value.shape
            down.outputs[0].name = f"{name}__{low.name.lower()}"
            for use in list(value.uses()):
                if use.node is not down:
                    use.node.replace_input_with(use.idx, stored)
            if value in outputs:
                graph.outputs[list(graph.outputs).index(value)] = stored
            graph.insert_after(node, [down, up])
    return copy


def _magnitude(array: np.ndarray) -> float:
    """Largest |x| that is a value, not a mask sentinel."""
    a = np.abs(np.asarray(array, np.float64))
    a = a[np.isfinite(a) & (a < SENTINEL)]
    return float(a.max()) if a.size else 0.0


def _error(low: np.ndarray, ref: np.ndarray) -> float:
    """max |low − ref| over the reference's values (not sentinels), relative to its scale."""
    low = np.asarray(low, np.float64)
    ref = np.asarray(ref, np.float64)
    if low.shape != ref.shape:
        return float("inf")
    values = np.isfinite(ref) & (np.abs(ref) < SENTINEL)
    if not values.any():
        return 0.0
    diff = np.abs(low[values] - ref[values])
    if not np.isfinite(diff).all():
        return float("inf")
    scale = max(float(np.abs(ref[values]).max()), 1e-6)
    return float(diff.max()) / scale


INTEGER_TYPES = {
    ir.DataType.INT64,
    ir.DataType.INT32,
    ir.DataType.INT16,
    ir.DataType.INT8,
    ir.DataType.UINT8,
    ir.DataType.BOOL,
}


def _index_arithmetic(model: ir.Model) -> list[tuple[ir.Node, ir.Node]]:
    """(node, cast) for every node whose fp32 value reaches a Cast to an integer type
    through fp32 values only: index arithmetic done in float (T5's log-spaced buckets, positions
    scaled and floored). A rounding there moves an index, so it stays exact."""
    found: dict[str, tuple[ir.Node, ir.Node]] = {}
    for cast in model.graph:
        if cast.op_type != "Cast" or cast.attributes.get_int("to") not in INTEGER_TYPES:
            continue
        frontier = [cast.inputs[0]]
        while frontier:
            value = frontier.pop()
            node = value.producer() if value is not None else None
            if node is None or value.dtype != ir.DataType.FLOAT or node.name in found:
                continue
            found[node.name] = (node, cast)
            frontier.extend(node.inputs)
    return list(found.values())


def _without_low_kernels(model: ir.Model, low: ir.DataType) -> list[ir.Node]:
    """Standard nodes with fp32 inputs whose schema admits no ``low`` type for them (Einsum
    has no bf16 at opset 23)."""
    import onnx

    wanted = f"tensor({'bfloat16' if low == ir.DataType.BFLOAT16 else 'float16'})"
    opset = model.opset_imports.get("", 1)
    found = []
    for node in model.graph:
        if node.domain not in ("", "ai.onnx"):
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, "")
        except onnx.defs.SchemaError:
            continue
        allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
        for formal, value in zip(schema.inputs, node.inputs, strict=False):
            types = allowed.get(formal.type_str)
            if value is not None and value.dtype == ir.DataType.FLOAT and types is not None:
                if wanted not in types:
                    found.append(node)
                    break
    return found


class _Growth:
    """The islands found so far: :meth:`add` keeps a node in fp32 once, with its reason. A
    kernel that writes the KV cache in place keeps the cache's type (the buffer is shared)."""

    def __init__(self, model: ir.Model, precision: str):
        self.precision = precision
        self.keep: set[str] = set()
        self.islands: list[Island] = []
        cache = set(contract.names_with_role(model, contract.PAST_KEY, contract.PAST_VALUE))
        self.fixed = {
            n.name for n in model.graph if any(v is not None and v.name in cache for v in n.inputs)
        }

    def add(self, node: ir.Node, reason: str) -> None:
        if node.name in self.fixed:
            logger.info(
                "%s stays %s: it writes the KV cache (%s)", node.name, self.precision, reason
            )
            return
        if node.name not in self.keep and node.op_type != "Constant":
            self.keep.add(node.name)
            self.islands.append(Island(node.name, node.op_type, layer_name(node), reason))


def _overflow_islands(growth: _Growth, names, values, producer, reference) -> dict | None:
    """Step 1 of the module doc: every value past :data:`OVERFLOW_LIMIT` keeps its producer and
    readers in fp32; the first such value in graph order, with its layer."""
    first_overflow = None
    for name in names:
        peak = max(_magnitude(run[name]) for run in reference if name in run)
        if peak <= OVERFLOW_LIMIT:
            continue
        node = producer[name]
        if first_overflow is None:
            first_overflow = {"value": name, "module": layer_name(node), "max_abs": peak}
        reason = f"max |x| = {peak:.4g} > {OVERFLOW_LIMIT:.4g} (fp16's range / 4)"
        growth.add(node, f"computes {name}: {reason}")
        for use in values[name].uses():
            growth.add(use.node, f"reads {name}: {reason}")
    return first_overflow


def _strays(errors: dict[str, float], producer, budget: float) -> list[tuple]:
    """(node, value, error) where a value strays past ``budget`` and its float inputs do not."""
    strays = []
    for name, err in errors.items():
        if err <= budget:
            continue
        node = producer[name]
        inputs = [v.name for v in node.inputs if v is not None and v.name in errors]
        if all(errors[i] <= budget for i in inputs):
            strays.append((node, name, err))
    return strays


def _grow(growth: _Growth, strays, errors, producer, budget: float) -> bool:
    """Strays join the islands, an island's stray inputs' producers too; whether any joined."""
    grew = False
    for node, name, err in strays:
        reason = f"{name} strays {err:.3g} of its scale in {growth.precision} (budget {budget:.3g})"
        if node.name not in growth.keep:
            growth.add(node, reason)
            grew = True
            continue
        for value in node.inputs:  # an island that needs its inputs exact
            source = producer.get(value.name) if value is not None else None
            if source is not None and value.name in errors and source.name not in growth.keep:
                growth.add(source, f"feeds island {node.name}, whose {reason}")
                grew = True
    return grew


def _error_rounds(growth: _Growth, model, feeds, names, producer, reference, budget) -> tuple:
    """Step 3 of the module doc: the rounds run (at most :data:`MAX_ROUNDS`), what strays."""
    low = LOW_TYPES[growth.precision]
    unresolved: list[dict] = []
    rounds = 0
    for rounds in range(1, MAX_ROUNDS + 1):  # noqa: B007 - the count is reported
        runs = run_exposed(emulate(model, low, frozenset(growth.keep)), names, feeds)
        pairs = list(zip(runs, reference, strict=True))
        errors = {
            name: max(_error(run[name], ref[name]) for run, ref in pairs)
            for name in names
            if all(name in run for run in runs)
        }
        strays = _strays(errors, producer, budget)
        unresolved = [
            {"value": name, "module": layer_name(node), "error": err} for node, name, err in strays
        ]
        if not strays or not _grow(growth, strays, errors, producer, budget):
            break
    return rounds, unresolved


def measure_islands(model: ir.Model, feeds: list[dict], precision: str) -> IslandReport:
    """The fp32 islands ``model`` (lowered, fp32) needs in ``precision`` (module doc)."""
    low = LOW_TYPES[precision]
    budget = ERROR_BUDGET[precision]
    common.ShapeInferencePass()(model)  # values later passes made may carry no type yet
    fill_float_types(model)
    names = _float_values(model)
    values = {out.name: out for node in model.graph for out in node.outputs}
    producer = {name: value.producer() for name, value in values.items()}
    reference = run_exposed(model, names, feeds)
    growth = _Growth(model, precision)
    first_overflow = None
    if low == ir.DataType.FLOAT16:
        first_overflow = _overflow_islands(growth, names, values, producer, reference)
    for node in _without_low_kernels(model, low):
        growth.add(node, f"ONNX defines no {precision} {node.op_type} at this opset")
    for node, cast in _index_arithmetic(model):
        growth.add(node, f"computes an index in float (read by {cast.name}, a Cast to integers)")
    rounds, unresolved = _error_rounds(growth, model, feeds, names, producer, reference, budget)
    return IslandReport(growth.keep, growth.islands, first_overflow, rounds, unresolved, budget)


def island_feeds(model: ir.Model, source, shapes) -> list[dict]:
    """The parity inputs as graph feeds: the source's inputs with attention masks of ones
    (a left-padded row's leading positions attend to nothing: any value is right there), and
    for a cached graph an empty past (a shared buffer with room for the prompt), length 0."""
    masks = set(
        contract.names_with_role(
            model,
            contract.ATTENTION_MASK,
            contract.ENCODER_ATTENTION_MASK,
            contract.ENCODER_SLOT_MASK,
        )
    )
    shared = bool(contract.names_with_role(model, contract.PAST_LENGTH))
    pasts = set(contract.names_with_role(model, contract.PAST_KEY, contract.PAST_VALUE))
    lengths = set(contract.names_with_role(model, contract.PAST_LENGTH))
    row_lengths = set(contract.names_with_role(model, contract.PAST_LENGTHS))
    feeds = []
    for i, (batch, seq) in enumerate(shapes):
        inputs = {n: v.numpy() for n, v in source.inputs(batch, seq, seed=i).items()}
        feed = {}
        for value in model.graph.inputs:
            if value.name in masks:  # no padding: a padded row's leading positions attend
                like = inputs.get(value.name)  # to nothing, any value
                if like is None:  # the slot mask export added: the encoder tokens' shape
                    tokens = contract.names_with_role(model, contract.ENCODER_TOKEN_IDS)
                    like = next(inputs[n] for n in tokens if n in inputs)
                feed[value.name] = np.ones_like(like)
            elif value.name in inputs:
                feed[value.name] = inputs[value.name]
            elif value.name in pasts:
                dims = list(value.shape)
                feed[value.name] = np.zeros(
                    (batch, dims[1], seq if shared else 0, dims[3]), np.float32
                )
            elif value.name in lengths:
                feed[value.name] = np.zeros([1], np.int64)
            elif value.name in row_lengths:
                feed[value.name] = np.zeros([batch], np.int64)
        feeds.append(feed)
    return feeds


def judge(got: np.ndarray, fp32: np.ndarray, low: np.ndarray, precision: str, keep=None) -> dict:
    """One output of an export in ``precision`` against fp32 eager and eager in ``precision``
    (the module doc's rule); ``keep`` selects compared positions as in parity."""
    got, fp32, low = (np.asarray(a, np.float64) for a in (got, fp32, low))
    if keep is not None and got.shape[:2] == keep.shape and not keep.all():
        got, fp32, low = got[keep], fp32[keep], low[keep]
    if got.shape != fp32.shape:
        return {"passed": False, "error": f"shape {got.shape} != eager {fp32.shape}"}
    scale = float(np.abs(fp32).max()) if fp32.size else 0.0
    export_err = float(np.abs(got - fp32).max()) if got.size else 0.0
    eager_err = float(np.abs(low - fp32).max()) if low.size else 0.0
    floor = FLOOR_ULPS * UNIT[precision] * max(scale, 1e-6)
    eager_finite = bool(np.isfinite(low).all())
    if eager_finite:
        allowed = ERROR_FACTOR * eager_err + floor
    else:  # eager itself overflowed in the precision: the export must stay within the budget
        allowed = ERROR_BUDGET[precision] * max(scale, 1e-6)
    finite = bool(np.isfinite(got).all())
    return {
        "max_abs_err": export_err,
        "max_rel_err": export_err / scale if scale > 0 else export_err,
        "eager_low_err": eager_err if eager_finite else float("inf"),
        "eager_low_finite": eager_finite,
        "allowed": allowed,
        "finite": finite,
        "passed": finite and export_err <= allowed,
    }


def apply_precision(
    model: ir.Model, source, precision: str, *, keep_io_types: bool, shapes
) -> dict:
    """Measure the islands on ``shapes``' parity inputs, convert ``model`` in place; what the
    report says of it."""
    islands = measure_islands(model, island_feeds(model, source, shapes), precision)
    ConvertPrecisionPass(LOW_TYPES[precision], frozenset(islands.keep), keep_io_types)(model)
    for island in islands.islands:
        logger.info("fp32 island %s (%s): %s", island.node, island.module, island.reason)
    if islands.first_overflow:
        o = islands.first_overflow
        logger.warning(
            "%s leaves fp16's range first at %s (%s: max |x| = %.4g); kept in fp32 from there",
            source.origin,
            o["module"] or "<top level>",
            o["value"],
            o["max_abs"],
        )
    return {
        "precision": precision,
        "keep_io_types": keep_io_types,
        **islands.as_dict(),
        "parity_rule": rule(precision),
    }


def check_precision(precision: str, keep_io_types: bool, target) -> None:
    """Refuse a precision the target cannot take, with what it can."""
    from tfgraph.errors import TfgraphError

    if precision not in PRECISIONS:
        raise TfgraphError(
            f"unknown precision '{precision}': choose one of {', '.join(PRECISIONS)}"
        )
    if precision not in target.precisions:
        raise TfgraphError(
            f"target '{target.label}' does not take --precision {precision}: choose one of "
            f"{', '.join(target.precisions)}"
        )
    if keep_io_types and precision == "fp32":
        raise TfgraphError("--keep-io-types needs --precision fp16 or bf16")
