"""Parity of an int8 KV cache, by a rule derived like the precision rule.

Quantizing K/V moves the outputs by an amount no fp32 tolerance can hold, and how much depends
on the model and the inputs. So the rule measures it: the **reference** is the fp32 graph with
the same symmetric int8 quantize/dequantize on every key and value entering a cached attention
(:class:`tfgraph.exporters.ort.int8_kv.FakeQuantized`), the math the int8 kernel does (measured:
5e-7 apart on one GroupQueryAttention). Its error against eager PyTorch, per output over the
same cache-parity cases (prefill and decode steps), is the quantization's own effect E. The
int8 artifact passes when its error against eager is within ``2·E + atol`` elementwise, plus
the fp32 ``rtol`` (the precision rule's factor 2: a rounding flip from fp32 noise moves an
output as much as the quantization does); a wrong scale, layout or kernel lands far outside.
Reported besides: the bound, E per phase, and 32 greedy tokens of the artifact against eager
fp32 (the agreement, not judged).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from tfgraph.verify.cache_parity import check_cache_parity, greedy_against_eager
from tfgraph.verify.tolerance import Tolerance

logger = logging.getLogger(__name__)

UNBOUNDED = Tolerance(atol=float("inf"), rtol=0.0)


def check_int8_cache(source, model_file: Path, reference_file: Path, options, shapes) -> dict:
    """The cache parity report of the int8 artifact at ``model_file`` against ``source``, with
    the bound measured on the fake-quantized fp32 graph at ``reference_file`` (its pending
    weights, if any, taken from the artifact's files first)."""
    from tfgraph.exporters.ort.int8_kv import fill_reference

    fill_reference(reference_file, model_file.parent)
    effect = check_cache_parity(source, reference_file, shapes=shapes, tolerance=UNBOUNDED)
    phases = {p: effect[p]["max_abs_err"] for p in ("prefill", "decode")}
    worst = max(phases.values())
    base = options.tolerance
    tolerance = dataclasses.replace(base, atol=base.atol + 2 * worst)
    parity = check_cache_parity(source, model_file, shapes=shapes, tolerance=tolerance)
    parity["kv_rule"] = {
        "rule": "|int8 - eager| <= 2 * E + atol + rtol * |eager|, E the largest error of the "
        "fp32 graph with K/V fake-quantized the same way",
        "quantization_effect": phases,
        "bound_atol": tolerance.atol,
    }
    parity["greedy"] = greedy_against_fp32(source, model_file)
    logger.info(
        "int8 KV cache: error %.3g within %.3g (quantization effect %.3g)",
        max(parity[p]["max_abs_err"] for p in ("prefill", "decode")),
        tolerance.atol,
        worst,
    )
    return parity


def greedy_against_fp32(source, model_file: Path, seed: int = 0) -> dict:
    """Greedy tokens of the artifact against eager fp32's choice on each of their prefixes
    (one teacher-forced pass; the first difference is where free-running greedy parts) for
    two prompts: how many agree. Reported, not judged: a random model's near ties decide
    some tokens."""
    from tfgraph.runtime import CachedDecoder, open_runner

    decoder = CachedDecoder(open_runner(model_file, checking=True))
    got, want, _, _, steps = greedy_against_eager(source, decoder, seed)
    equal = sum(x == y for a, b in zip(got, want, strict=True) for x, y in zip(a, b, strict=False))
    parts = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        for a, b in zip(got, want, strict=True)
    ]
    first = min((p for p in parts if p is not None), default=None)
    return {"steps": steps, "tokens": sum(len(r) for r in got), "equal_to_fp32_eager": equal,
            "first_difference": first}  # fmt: skip
