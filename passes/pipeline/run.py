"""The one step runner of an export: every graph rewrite — the pipeline's passes, the precision
steps, the encoder split, paging — timed, logged and recorded alike (:class:`Steps`), checked
(the ONNX checker and strict shape inference, a failing check naming the step that broke the
graph), dumped on request (``--dump-after``) and followed by the parity probe
(:mod:`.probe`) with ``check_each_pass`` (or ``TFGRAPH_CHECK_EACH_PASS=1``).

Pipeline passes are checked after the pipeline (after each with ``check_each_pass``); the steps
after it always. A step that changes values by design (precision, quantization) re-bases the
probe instead of being compared with the graph before it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common

from tfgraph.errors import TfgraphError
from tfgraph.passes import PIPELINES, PipelineOptions, build_pipeline, pass_names
from tfgraph.passes.cache.insert_kv_cache import KVCacheError
from tfgraph.passes.pipeline.probe import (  # noqa: F401 - re-exported
    CHECK_EACH_PASS_ENV,
    GraphCheckError,
    ParityProbe,
    run_in_ort,
)
from tfgraph.passes.skeleton import skeleton

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassRecord:
    name: str
    seconds: float
    modified: bool

    def as_dict(self) -> dict:
        return {"name": self.name, "seconds": round(self.seconds, 4), "modified": self.modified}


# Checks look at types and shapes, not at weight values: larger initializers are handed to the
# checker as graph inputs of the same type and shape (never read: a lazily bound checkpoint
# stays on disk), which keeps a check of GPT-2-small to a fraction of a second.
_UNCHECKED = "tfgraph.unchecked"  # a custom domain: the checker takes its ops unvalidated


def _checkable(model: ir.Model, nonstandard: frozenset) -> onnx.ModelProto:
    proto = skeleton(model)
    moved = False
    for node in proto.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type in nonstandard:
            node.domain = _UNCHECKED
            moved = True
    if moved and not any(o.domain == _UNCHECKED for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid(_UNCHECKED, 1))
    return proto


def check_model(model: ir.Model, after: str, nonstandard: frozenset = frozenset()) -> None:
    """ONNX checker and strict shape inference; raises naming the pass ``after``.

    Ops that the target emits in the default domain although ONNX has no such op (its
    ``nonstandard_default_ops``, handed in as ``nonstandard`` by
    :func:`tfgraph.exporters.compile.check_model`) are shown to the checker as a custom
    domain, which it does not validate. Inferred shapes are then recorded in the graph
    (``ShapeInferencePass``).
    """
    proto = _checkable(model, nonstandard)
    for name, check in (
        ("ONNX checker", lambda: onnx.checker.check_model(proto)),
        (
            "shape inference",
            lambda: onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True),
        ),
    ):
        try:
            check()
        except Exception as exc:
            raise GraphCheckError(
                f"{name} failed after {after}: {str(exc).strip().splitlines()[0]}"
            ) from exc
    common.ShapeInferencePass()(model)


# the steps of an export after the pipeline: valid ``--dump-after`` names too
EXPORT_STEPS = (
    "ConvertPrecisionPass",
    "MatMulNBitsQuantizer",
    "QuantizeKVCachePass",
    "SplitEncoderPass",
    "PagedAttentionPass",
)


class Steps:
    """Runs every rewrite of one export's graph the same way: one :class:`PassRecord` each (in
    ``records``), the checks, the dump after ``dump_after``, the parity probe."""

    def __init__(
        self,
        target,
        *,
        check_each_pass: bool = False,
        dump_after: str | None = None,
        dump_dir: Path | None = None,
    ) -> None:
        self.target = target  # a Target object: its nonstandard default-domain ops
        self.check_each_pass = check_each_pass or os.environ.get(CHECK_EACH_PASS_ENV) == "1"
        self.dump_after, self.dump_dir = dump_after, dump_dir
        self.records: list[PassRecord] = []
        self.probe = ParityProbe()
        self._probing = self._ended = False

    def check(self, model: ir.Model, after: str) -> None:
        check_model(model, after, self.target.nonstandard_default_ops)

    def run(self, name: str, rewrite, model: ir.Model, *, check=True, exact=True, changed=None):
        """``rewrite()`` (which changes ``model`` in place) as the step ``name``; its value.
        ``exact=False``: values change by design, the probe re-bases on the result;
        ``exact=None``: the graph's signature changes (the encoder split) or it stops running
        on the CPU (paging): the probe ends. ``changed(value)``: whether it modified the
        graph (default: the value's ``modified``, else True)."""
        logger.debug("running %s", name)
        if self.check_each_pass and not self._probing and not self._ended:
            self.probe.start(model)
            self._probing = True
        start = time.perf_counter()
        value = rewrite()
        seconds = time.perf_counter() - start
        modified = bool(changed(value) if changed else getattr(value, "modified", True))
        self.records.append(PassRecord(name, seconds, modified))
        logger.info("%s: %.3f s, modified=%s", name, seconds, modified)
        if check or self.check_each_pass:
            self.check(model, name)
        if self.check_each_pass and modified and self._probing:
            if exact is None:
                self._probing = False  # and stays off: later graphs are not comparable
                self._ended = True
            elif exact:
                self.probe.after(model, name)
            else:
                self.probe.start(model)
        if self.dump_after == name and self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            ir.save(model, self.dump_dir / f"after_{name}.onnx")
        return value

    def pipeline(self, model: ir.Model, name: str, options: PipelineOptions) -> None:
        """Pipeline ``name`` over ``model`` in place, a step per pass, checked at its end."""
        passes = _build(self.target, name, options)
        names = pass_names(passes)
        if self.dump_after is not None and self.dump_after not in (*names, *EXPORT_STEPS):
            raise TfgraphError(
                f"--dump-after {self.dump_after}: pipeline '{name}' has no such pass; choose "
                f"one of {', '.join(names)}"
            )
        for p, pass_name in zip(passes, names, strict=True):
            self.run(pass_name, lambda p=p, n=pass_name: _call(p, n, model), model, check=False)
        self.check(model, f"pipeline '{name}'")


def _build(target, name: str, options: PipelineOptions) -> list:
    if name not in PIPELINES:
        raise TfgraphError(f"unknown pipeline '{name}': choose one of {', '.join(PIPELINES)}")
    try:
        return build_pipeline(target, options, name=name)
    except ValueError as exc:
        raise TfgraphError(f"{exc}: use --pipeline default with --kv-cache") from exc


def _call(p, pass_name: str, model: ir.Model):
    try:
        return p(model)
    except KVCacheError as exc:
        raise TfgraphError(f"cannot insert a KV cache: {exc}") from exc
    except ir.passes.PreconditionError as exc:
        cause = f": {exc.__cause__}" if exc.__cause__ else ""
        raise TfgraphError(f"{pass_name} cannot run here: {exc}{cause}") from exc


def run_pipeline(
    model: ir.Model,
    name: str,
    *,
    target,
    check_each_pass: bool = False,
    dump_after: str | None = None,
    dump_dir: Path | None = None,
    kv_cache: bool = False,
    max_positions: int | None = None,
    row_lengths: bool = True,
) -> list[PassRecord]:
    """Apply pipeline ``name`` for ``target`` (a :class:`tfgraph.exporters.target.Target`
    object: :func:`tfgraph.exporters.compile.run_pipeline` resolves names) in place; one
    record per pass, named uniquely (:func:`tfgraph.passes.pass_names`). ``dump_after`` names
    one of those."""
    steps = Steps(target, check_each_pass=check_each_pass, dump_after=dump_after, dump_dir=dump_dir)
    options = PipelineOptions(
        kv_cache=kv_cache, max_positions=max_positions, row_lengths=row_lengths
    )
    steps.pipeline(model, name, options)
    return steps.records
