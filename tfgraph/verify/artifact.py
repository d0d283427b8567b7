"""The verification stage of ``export``: the staged artifact against eager PyTorch, by the
rule of its precision — one forward pass (:func:`check_parity`), or prefill and decode steps
through the cache with greedy tokens (:func:`check_cache_parity`) — and, for quantized
weights, how far the dequantized model is from the fp32 one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tfgraph.verify.cache_parity import check_cache_parity
from tfgraph.verify.parity import check_parity
from tfgraph.verify.quantization_error import quantization_error


def check_artifact(reference, model_file: Path, options, shapes) -> dict:
    """The parity report of ``model_file`` against ``reference`` (the eager model the artifact
    should compute: the source, or its dequantized copy)."""
    check = check_cache_parity if options.kv_cache else check_parity
    tolerance = options.tolerance
    if options.weights:  # the kernel's fp32 noise follows the output's scale (Tolerance)
        tolerance = dataclasses.replace(tolerance, scaled=True)
    return check(
        reference,
        model_file,
        shapes=shapes,
        tolerance=tolerance,
        precision=options.precision,
    )


def weights_error(source, reference, model_file: Path, options, shapes) -> dict:
    """``error_vs_fp32`` of a weight-quantized export: logits on the parity inputs, and greedy
    tokens of both eager models for a cached artifact."""
    return quantization_error(source, reference, model_file if options.kv_cache else None, shapes)
