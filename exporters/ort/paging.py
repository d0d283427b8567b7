"""``--kv-layout paged``: the export step that pages an ``ort-cuda`` artifact's KV cache.

The shared-buffer graph is what parity runs (GroupQueryAttention has a CPU kernel; ``export``
saves it in a scratch directory); after it passes,
:func:`tfgraph.exporters.ort.paged_attention.lower_to_paged` rewrites every cached layer into
``com.microsoft.PagedAttention`` (CUDA only), and the artifact is saved with the paged
signature. What is proven, and what is not, goes into ``report.json`` ``paged``:

- the graph is well-formed: ONNX Runtime's CPU session creation on the saved file gets past
  graph resolution and type inference and stops at kernel assignment (:data:`NO_KERNEL`); any
  other error fails the export (the ONNX checker's pass over a paged graph is in the test
  suite: run here on the file, it cannot follow external data a save left beside it);
- the numbers of the paged graph are **not** measured here: parity was measured on the graph
  before paging, and the mapping between the two layouts is checked by the test suite
  (tests/exporters/ort/test_paged_attention.py), not per export.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx_ir as ir

from tfgraph.errors import TfgraphError, first_line

logger = logging.getLogger(__name__)

KV_LAYOUTS = ("shared", "paged")
NO_KERNEL = "Could not find an implementation for PagedAttention"


def check_kv_layout(options, target) -> None:
    """Refuse a paged cache the export cannot build, before any slow work."""
    from tfgraph.exporters.ort.paged_attention import valid_block_size

    layout = options.kv_layout
    if layout not in KV_LAYOUTS:
        raise TfgraphError(f"--kv-layout must be one of {', '.join(KV_LAYOUTS)}, not {layout!r}")
    if layout == "shared":
        return
    if layout not in target.kv_layouts:
        raise TfgraphError(
            f"target '{target.name}' has no {layout} KV cache: PagedAttention runs on ONNX "
            "Runtime's CUDA provider only; export with --target ort-cuda"
        )
    if not options.kv_cache:
        raise TfgraphError("--kv-layout paged pages the KV cache: add --kv-cache")
    if options.precision not in ("fp16", "bf16"):
        raise TfgraphError(
            "--kv-layout paged needs --precision fp16 (PagedAttention takes float16 or "
            "bfloat16 only)"
        )
    if not options.row_lengths:
        raise TfgraphError("--kv-layout paged reads each row's past length: drop --no-row-lengths")
    if options.kv_dtype != "fp32":
        raise TfgraphError("--kv-layout paged with --kv-dtype int8 is not supported yet")
    if not valid_block_size(options.kv_block_size):
        raise TfgraphError(
            f"--kv-block-size {options.kv_block_size}: PagedAttention's CUDA kernel takes a "
            "power of two of at least 16"
        )


def page(graph: ir.Model, block_size: int, steps) -> None:
    """Page ``graph`` in place (its shared-buffer copy already saved for parity): a step of the
    export's step runner."""
    from tfgraph.exporters.ort.paged_attention import lower_to_paged

    def rewrite() -> None:
        try:
            lower_to_paged(graph, block_size)
        except ValueError as error:
            raise TfgraphError(f"{error} (export without --kv-layout paged)") from None

    steps.run("PagedAttentionPass", rewrite, graph, exact=None)  # no CPU kernel: not probed


def paged_report(graph: ir.Model, model_file: Path, block_size: int) -> dict:
    """The report entry ``paged`` of the saved paged artifact ``model_file``."""
    return {
        "layers": sum(1 for n in graph.graph if n.op_type == "PagedAttention"),
        "block_size": block_size,
        "session_check": _session_check(model_file),
        "parity": "measured on the shared-buffer graph before paging (PagedAttention has no "
        "CPU kernel); the paged graph's numbers are unverified until run on a GPU",
    }


def _session_check(path: Path) -> str:
    """ONNX Runtime's CPU session on the paged graph: it must fail at kernel assignment only."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # noqa: BLE001 - ORT raises its own exception types
        if NO_KERNEL in str(error):
            return "graph resolved and type-checked; stopped at kernel assignment (CPU)"
        raise TfgraphError(f"the paged graph does not load: {first_line(str(error))}") from None
    return "loaded on the CPU provider"
