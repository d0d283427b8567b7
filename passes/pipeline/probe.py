"""The parity probe of ``check_each_pass``: after every pass that modified the graph, the graph
runs in ONNX Runtime on one small random input and its outputs are compared with those of the
graph before the pipeline (``|after − before| ≤ 1e-4 + 1e-3·|before|``). Canonical ``tfgraph``
ops do not run in ONNX Runtime, so the probe waits (and logs so) while any is in the graph."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from tfgraph import contract
from tfgraph.errors import TfgraphError, first_line
from tfgraph.passes.rewrite_utils import weight_bytes

logger = logging.getLogger(__name__)


class GraphCheckError(TfgraphError):
    """The ONNX checker or shape inference rejected the graph after a pass."""

    exit_code = 1


CHECK_EACH_PASS_ENV = "TFGRAPH_CHECK_EACH_PASS"  # "1": check every pass, whatever the caller
PROBE_ATOL, PROBE_RTOL = 1e-4, 1e-3
CANONICAL_DOMAIN = "tfgraph"
_PROBE_MAX_BYTES = 1 << 30  # larger models are not serialized once more per pass
_PROBE_SIZES = {"batch": 2, "sequence": 5, "total_sequence": 5, "max_sequence": 5}
_PROBE_OTHER_DIM = 3


def _has_canonical_ops(model: ir.Model) -> bool:
    nodes = ir.traversal.RecursiveGraphIterator(model.graph)
    return any(n.domain == CANONICAL_DOMAIN for n in nodes)


def _input_key(value: ir.Value) -> tuple:
    return (str(value.dtype), str(value.shape))


def _dim_size(dim) -> int:
    if isinstance(dim, int):
        return dim
    name = str(dim.value) if dim.value is not None else ""
    if name == contract.PAST_DIM:
        return 0  # an empty cache: the graph must then compute what it did without one
    return _PROBE_SIZES.get(name, _PROBE_OTHER_DIM)


def _index_bound(value: ir.Value) -> int:
    """Integers fed to a Gather of a constant table stay below its first dim (token ids)."""
    bound = None
    for node, index in value.uses():
        table = node.inputs[0] if node.op_type == "Gather" and index == 1 else None
        if table is not None and table.const_value is not None and table.shape:
            rows = table.shape[0]
            if isinstance(rows, int):
                bound = rows if bound is None else min(bound, rows)
    return bound or 2


_MASKS = (contract.ATTENTION_MASK, contract.ENCODER_ATTENTION_MASK, contract.ENCODER_SLOT_MASK)


def _probe_feed(value: ir.Value, role: str, rng: np.random.Generator) -> np.ndarray:
    shape = [_dim_size(d) for d in value.shape] if value.shape is not None else []
    dtype = value.dtype.numpy() if value.dtype is not None else np.float32
    if role in (contract.PAST_LENGTH, contract.PAST_LENGTHS):
        return np.zeros(shape, dtype)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    if dtype == np.bool_ or role in _MASKS:
        return np.ones(shape, dtype)
    return rng.integers(0, _index_bound(value), shape).astype(dtype)


def run_in_ort(
    model: ir.Model | bytes,
    feeds: list[dict[str, np.ndarray]],
    initializers: dict[str, np.ndarray] | None = None,
) -> list[dict]:
    """Run an ``onnx_ir`` model (or a serialized one) in one ONNX Runtime CPU session (its own
    optimizations off, one thread) on each feed; ``{output name: array}`` per feed.
    ``initializers`` are handed to the session in place (``add_external_initializers``): the
    serialized model then declares them as external data that is never read."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # a probe that fails raises; ORT must not also print it
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    if initializers:
        values = [ort.OrtValue.ortvalue_from_numpy(a) for a in initializers.values()]
        options.add_external_initializers(list(initializers), values)
    data = model if isinstance(model, bytes) else ir.serde.serialize_model(model)
    data = data if isinstance(data, bytes) else data.SerializeToString()
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    inputs = [i.name for i in session.get_inputs()]
    return [
        dict(zip(names, session.run(None, {n: feed[n] for n in inputs}), strict=True))
        for feed in feeds
    ]


def _run_in_ort(model: ir.Model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return run_in_ort(model, [feeds])[0]


def _mismatch(got: np.ndarray, want: np.ndarray) -> str | None:
    if got.shape != want.shape:
        return f"shape {got.shape}, before {want.shape}"
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    if not np.array_equal(np.isnan(got64), np.isnan(want64)):
        return "NaN where the graph before had none (or the reverse)"
    diff = np.abs(np.nan_to_num(got64 - want64))
    if np.all(diff <= PROBE_ATOL + PROBE_RTOL * np.abs(np.nan_to_num(want64))):
        return None
    return f"max |after - before| = {diff.max():.3g}"


@dataclass
class ParityProbe:
    """The graph before the pipeline, run once on one small random input; each probe runs the
    current graph on the same input and compares the outputs both graphs have."""

    feeds: dict[str, np.ndarray] = field(default_factory=dict)
    keys: dict[str, tuple] = field(default_factory=dict)
    reference: dict[str, np.ndarray] | None = None
    reference_inputs: frozenset[str] = frozenset()
    pending: list[str] = field(default_factory=list)  # passes that changed it since a probe
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def start(self, model: ir.Model) -> None:
        if _has_canonical_ops(model) or self._too_large(model):
            logger.info("parity probe off: the graph before the pipeline does not run here")
            return
        self._feed(model)
        self.reference_inputs = frozenset(self.feeds)
        try:
            self.reference = _run_in_ort(model, self.feeds)
        except Exception as exc:
            logger.info("parity probe off: the graph before the pipeline fails in ORT: %s", exc)

    def after(self, model: ir.Model, pass_name: str) -> None:
        if self.reference is None:
            return
        self.pending.append(pass_name)
        if _has_canonical_ops(model):
            logger.info("parity probe skipped after %s: canonical tfgraph ops present", pass_name)
            return
        guessed = self._feed(model)
        try:
            outputs = _run_in_ort(model, self.feeds)
        except Exception as exc:
            if guessed:  # inputs new since the reference: the probe's guess may be at fault
                logger.info("parity probe skipped after %s (new inputs): %s", pass_name, exc)
                return
            first = first_line(exc)
            raise GraphCheckError(
                f"parity probe failed after {self._suspects()}: ONNX Runtime cannot run it: {first}"
            ) from exc
        self._compare(outputs, pass_name)
        self.pending.clear()

    def _suspects(self) -> str:
        """The pass just run, and those that changed the graph unprobed before it."""
        *before, last = self.pending
        return f"{last} (or the unprobed {', '.join(before)})" if before else last

    def _compare(self, outputs: dict[str, np.ndarray], pass_name: str) -> None:
        common = [n for n in outputs if n in self.reference]
        for name in common:
            problem = _mismatch(outputs[name], self.reference[name])
            if problem:
                raise GraphCheckError(
                    f"parity probe failed after {self._suspects()}: output '{name}' changed "
                    f"({problem}; tolerance {PROBE_ATOL:g} + {PROBE_RTOL:g}·|before|)"
                )
        # the class name first (what a reader greps for), then the pass's unique name
        base = pass_name.split("#")[0]
        where = f" ({pass_name})" if base != pass_name else ""
        logger.info("parity probe after %s: %d output(s) match%s", base, len(common), where)

    def _feed(self, model: ir.Model) -> bool:
        """Inputs for the graph's inputs, reusing the reference's; True when some are new."""
        guessed = False
        roles = {p.name: p.role for p in contract.signature_of(model).inputs}
        for value in model.graph.inputs:
            key = _input_key(value)
            if self.keys.get(value.name) == key:
                continue
            if value.name in self.reference_inputs:  # the reference ran on another input
                logger.info("parity probe off: input %s changed to %s", value.name, key)
                self.reference = {}
            self.feeds[value.name] = _probe_feed(value, roles[value.name], self.rng)
            self.keys[value.name] = key
            guessed = True
        return guessed

    @staticmethod
    def _too_large(model: ir.Model) -> bool:
        return weight_bytes(model) > _PROBE_MAX_BYTES
