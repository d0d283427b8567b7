"""Rows at different lengths, checked on every artifact that takes per-row past lengths.

Cache parity (:mod:`.cache_parity`) feeds every row of a batch the same past length; an
artifact whose ``kv_layout.row_lengths`` names an input promises more — rows of one batch
at their own lengths, as in-flight batching runs them (:class:`tfgraph.runtime.SlotBatcher`).
This check makes the artifact keep it: three requests decoded through two slots (the second
joins while the first runs, the third takes a freed slot) against each request decoded alone
by the same artifact, every step's logits within the fp32 tolerance. Prompts come from the
source's own inputs; an encoder-decoder's prompts feed its encoder.

Tokens are **sampled** (seeded per request, the same seed alone): a random-weight model
decoding greedily often repeats one token, and over keys that are all one token every
weighting of them (a wrong length, a wrong position bias) gives the same output, so a broken
row would pass. A batched step differs from a batch of one by fp32 (or fp16) noise only,
which moves a sampled token only when its uniform draw falls within that noise of a boundary:
the comparison of a request stops at the step where its tokens part, that step's logits
compared (``sampled_apart_at`` in the report).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from tfgraph.errors import TfgraphError
from tfgraph.verify.tolerance import Tolerance

__all__ = ["ROW_RULE", "check_row_parity", "row_tolerance"]

logger = logging.getLogger(__name__)

LENGTHS = (7, 3, 5)  # the prompts' lengths
NEW_TOKENS = 6
ARRIVALS = (0, 2, 3)  # the second joins a running batch; the third waits for a slot
SEEDS = (11, 12, 13)
ROW_RULE = (  # kernels that quantize activations (row_tolerance)
    "|batched - alone| <= 2 x the largest error the decode steps' rule allowed: each is "
    "within it of the reference"
)


# units of the precision, relative to the largest logit, that a batched step may differ from a
# batch of one in fp16/bf16 (the kernels round at node boundaries; fp32 keeps its tolerance)
LOW_PRECISION_UNITS = 10
EPS = {"fp16": 2.0**-10, "bf16": 2.0**-7}


def row_tolerance(
    tolerance: Tolerance, precision: str, decode_allowed: float | None = None
) -> Tolerance:
    """The artifact against itself, batched against alone: the fp32 tolerance, or in fp16 /
    bf16 ten units of the precision at the logits' scale.

    ``decode_allowed``: for kernels that quantize activations (``MatMulNBits`` at accuracy
    level 4), the largest error the rule of the same artifact's decode steps allowed. Each
    row's product is its own (the kernel quantizes and multiplies row by row), but the fp32
    kernels around it may sum in another order for a batch of two than for one (reported on
    an AVX2 machine, up to 0.2 at 7B; bitwise equal on an AVX-512 VNNI one), and a
    difference of 1e-7 flips an activation's int8 rounding in the next layer, which moves
    the logits by as much as the activation quantization itself
    (:mod:`tfgraph.verify.activation_rule`). Batched and alone are each within that
    allowance of the reference, so within twice it of each other; a row read at a wrong
    length or position moves by far more
    (``tests/exporters/ort/weights/test_quantized_cache_rows.py``)."""
    if decode_allowed:
        return Tolerance(atol=2 * decode_allowed, rtol=0.0)
    if precision not in EPS:
        return tolerance
    return Tolerance(atol=0.0, rtol=LOW_PRECISION_UNITS * EPS[precision], scaled=True)


def check_row_parity(
    source, decoder, tolerance: Tolerance, seed: int = 0, alone=None
) -> dict | None:
    """The report of rows at different lengths on ``decoder`` (a
    :class:`tfgraph.runtime.CachedDecoder` over the artifact: the session cache parity
    opened, not a second one), or None when the artifact takes none. ``alone``: the decoder
    each request runs through alone (default ``decoder``; another one stands for a kernel
    path that differs with the batch, in tests)."""
    from tfgraph import contract
    from tfgraph.runtime import GenerationConfig, generate
    from tfgraph.runtime.generate import seq2seq_prompts
    from tfgraph.runtime.inflight import (
        generate_inflight,
        inflight_support,
        without_prompt_inputs,
    )

    if not decoder.session.signature.row_lengths:
        return None
    why = inflight_support(decoder)
    try:  # a VLM's text rows: no image (an input with no such default: each request's own)
        without_prompt_inputs(decoder, 1)
    except TfgraphError as exc:
        why = why or str(exc)
    if why is not None:  # per-row lengths, but a step graph in-flight batching cannot feed
        return {"passed": True, "skipped": why}
    name = decoder.token_input
    if decoder.seq2seq:
        name = next(p.name for p in decoder._all_inputs() if p.role == contract.ENCODER_TOKEN_IDS)
    ids = source.inputs(1, max(LENGTHS), seed=seed + 21)[name].numpy()[0]
    prompts = [ids[:n].tolist() for n in LENGTHS]
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=True)
    capacity = max(LENGTHS) + NEW_TOKENS
    got = generate_inflight(
        decoder, prompts, config, arrivals=ARRIVALS, seeds=SEEDS, slots=2, capacity=capacity,
        encoder_capacity=max(LENGTHS), keep_logits=True,
    )  # fmt: skip
    worst, passed, parted = 0.0, True, []
    for prompt, seed, request in zip(prompts, SEEDS, got, strict=True):
        start, extra = [prompt], without_prompt_inputs(decoder, 1)  # a VLM's text rows
        if decoder.seq2seq:
            start, extra = seq2seq_prompts(decoder, [prompt], 0, 0)
        single = generate(
            alone or decoder, start, replace(config, seed=seed), extra=extra, keep_logits=True
        )
        steps = zip(  # as long as both (no EOS here: both are NEW_TOKENS long)
            request.tokens, single.tokens[0], request.logits, single.step_logits, strict=False
        )
        for t, (mine_token, their_token, mine, theirs) in enumerate(steps):
            diff = np.abs(mine.astype(np.float64) - theirs[0])
            worst = max(worst, float(diff.max()))
            passed &= bool(np.all(diff <= tolerance.bound(theirs[0])))
            if mine_token != their_token:  # logits within the tolerance drew apart: a draw on
                parted.append(t)  # a boundary (fp16 noise); the rest decodes other tokens
                break
    logger.info("row parity: max abs err %.3g (%s)", worst, "pass" if passed else "FAIL")
    return {
        "passed": passed,
        "max_abs_err": worst,
        "requests": len(prompts),
        "prompt_lengths": list(LENGTHS),
        "new_tokens": NEW_TOKENS,
        "sampled_apart_at": parted,  # steps where a request's draw parted within tolerance
        "tolerance": tolerance.as_dict(),
    }
