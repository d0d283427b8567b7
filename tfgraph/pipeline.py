"""Run a named pass pipeline: every pass timed and logged, checks after the pipeline (and after
each pass with ``check_each_pass``), a failing check naming the pass that broke the graph."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common

from tfgraph.passes import PIPELINES, get_pipeline
from tfgraph.passes.insert_kv_cache import KVCacheError

from .errors import TfgraphError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassRecord:
    name: str
    seconds: float
    modified: bool

    def as_dict(self) -> dict:
        return {"name": self.name, "seconds": round(self.seconds, 4), "modified": self.modified}


class GraphCheckError(TfgraphError):
    """The ONNX checker or shape inference rejected the graph after a pass."""

    exit_code = 1


# ONNX Runtime kernels registered in the default domain although ONNX has no such op; the ONNX
# checker sees them as in a custom domain, which it does not validate.
ORT_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})


# Checks look at types and shapes, not at weight values: larger initializers are handed to the
# checker as graph inputs of the same type and shape, which keeps a check of GPT-2-small to a
# fraction of a second instead of seconds.
_WEIGHT_BYTES = 1 << 16


def _checkable(model: ir.Model) -> onnx.ModelProto:
    proto = ir.serde.serialize_model(model)
    weights = [t for t in proto.graph.initializer if len(t.raw_data) > _WEIGHT_BYTES]
    for tensor in weights:
        proto.graph.input.append(
            onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))
        )
        proto.graph.initializer.remove(tensor)
    moved = False
    for node in proto.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type in ORT_DEFAULT_DOMAIN_OPS:
            node.domain = "com.microsoft"
            moved = True
    if moved and not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return proto


def check_model(model: ir.Model, after: str) -> None:
    """ONNX checker and strict shape inference; raises naming the pass ``after``.

    Inferred shapes are then recorded in the graph (``ShapeInferencePass``).
    """
    proto = _checkable(model)
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


def run_pipeline(
    model: ir.Model,
    name: str,
    *,
    profile: str = "ort",
    check_each_pass: bool = False,
    dump_after: str | None = None,
    dump_dir: Path | None = None,
    kv_cache: bool = False,
) -> list[PassRecord]:
    """Apply pipeline ``name`` in place and return one record per pass."""
    if name not in PIPELINES:
        raise TfgraphError(f"unknown pipeline '{name}': choose one of {', '.join(PIPELINES)}")
    try:
        passes = get_pipeline(name, profile, kv_cache=kv_cache)
    except ValueError as exc:
        raise TfgraphError(f"{exc}: use --pipeline default with --kv-cache") from exc
    records = []
    for p in passes:
        pass_name = type(p).__name__
        logger.debug("running pass %s", pass_name)
        start = time.perf_counter()
        try:
            result = p(model)
        except KVCacheError as exc:
            raise TfgraphError(f"cannot insert a KV cache: {exc}") from exc
        seconds = time.perf_counter() - start
        records.append(PassRecord(pass_name, seconds, bool(result.modified)))
        logger.info("pass %s: %.3f s, modified=%s", pass_name, seconds, result.modified)
        if check_each_pass:
            check_model(model, pass_name)
        if dump_after == pass_name and dump_dir is not None:
            dump_dir.mkdir(parents=True, exist_ok=True)
            ir.save(model, dump_dir / f"after_{pass_name}.onnx")
    check_model(model, f"pipeline '{name}'")
    return records
