"""Parity of a KV-cached artifact against eager PyTorch, for prefill and for decode steps.

- **Prefill**: at each parity shape, the cached graph with an empty past against the eager
  model on the same tokens (every position's logits).
- **Decode**: a prompt of ``DECODE_PROMPT`` tokens, then ``DECODE_STEPS`` single-token steps on
  the cache (teacher-forced with the tokens of a random sequence, so that a near tie in argmax
  cannot hide or fake an error); each step's logits against eager on the whole sequence, whose
  row t is what a full recompute of the prefix up to t gives (a cached model is causal; one
  eager pass instead of one per step: a streamed 7B checkpoint reads 13 GB per pass). Batch 2.

Both use :func:`tfgraph.verify.parity.compare` and the same tolerance as the uncached
parity. A cached graph is causal, so positions before a row's first token (left padding)
are not compared (:func:`tfgraph.verify.parity.defined_positions`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from tfgraph import contract
from tfgraph.runtime import CachedDecoder, open_runner
from tfgraph.sources import ModelSource
from tfgraph.verify.parity import (
    BRACKET_KEYS,
    FP32,
    PARITY_SHAPES,
    Tolerance,
    compare_fp32,
    compare_in,
    defined_positions,
    eager_device,
    eager_outputs,
    ruling,
    runner_info,
)

logger = logging.getLogger(__name__)

DECODE_PROMPT, DECODE_STEPS, DECODE_BATCH = 5, 4, 2


def _split(source: ModelSource, decoder: CachedDecoder, inputs: dict) -> tuple:
    """(new tokens, the other inputs: encoder inputs and, for encoder-decoder artifacts, the
    cross-attention K/V the encoder graph computed once)."""
    tokens = inputs[decoder.token_input].numpy()
    arrays = {n: v.numpy() for n, v in inputs.items() if n != decoder.token_input}
    extra = {n: arrays[n] for n in decoder.extra_inputs if n in arrays}
    extra.update(decoder.encode(arrays))
    return tokens, extra


def _mask(decoder: CachedDecoder, inputs: dict, length: int) -> np.ndarray | None:
    """The source's own padding mask over the first ``length`` positions (past + new)."""
    if decoder.mask_input is None:
        return None
    return inputs[decoder.mask_input][:, :length].numpy()


def _row(
    source, inputs, name, got, tolerance, keep, precision, rows=slice(None), eager=None
) -> dict:
    """``got`` against eager on ``inputs`` (the logits' ``rows`` of the sequence), by the
    fp32 tolerance or by the rule of ``precision``; ``eager``: those outputs already run."""
    want, want_low = eager if eager is not None else eager_outputs(source, inputs, precision)
    if want_low is None:
        return compare_fp32(source, inputs, name, got, want[name][:, rows], tolerance, keep, rows)
    low = want_low[name][:, rows]
    return compare_in(name, got, want[name][:, rows], low, precision, keep, tolerance)


def check_cache_parity(
    source: ModelSource,
    model_file: Path,
    *,
    shapes=PARITY_SHAPES,
    tolerance: Tolerance = FP32,
    seed: int = 0,
    precision: str = "fp32",
) -> dict:
    """Prefill and decode parity of the cached artifact ``model_file`` (module doc), the rows
    check, and in a low precision the greedy tokens' agreement: the report's parity section."""
    decoder = CachedDecoder(open_runner(model_file, checking=True))
    source = source.on_device(eager_device(decoder.session))
    name = source.output_names[0]
    cases = _prefill_cases(source, decoder, name, shapes, tolerance, seed, precision)
    cases += _decode_cases(source, decoder, name, tolerance, seed, precision)
    summary = _phase_summaries(cases)
    phases = [summary["prefill"], summary["decode"]]
    if precision != "fp32":
        summary["greedy"] = greedy_in_precision(source, decoder, precision, seed)
    outputs = [_output(name, phases, cases, tolerance)]
    rows = _rows(source, decoder, cases, tolerance, precision, seed)
    return {
        "passed": outputs[0]["passed"] and (rows is None or rows["passed"]),
        "outputs": outputs,
        "cases": cases,
        "shapes": [list(s) for s in shapes],
        **summary,
        **({"rows": rows} if rows is not None else {}),
        "decode_steps": DECODE_STEPS,
        "runner": runner_info(decoder.session),
        "eager_device": source.device,
    }


def _prefill_cases(source, decoder, name, shapes, tolerance, seed, precision) -> list[dict]:
    """At each parity shape, the cached graph with an empty past against eager."""
    cases = []
    for i, (batch, seq) in enumerate(shapes):
        inputs = source.inputs(batch, seq, seed=seed + i)
        tokens, extra = _split(source, decoder, inputs)
        mask = _mask(decoder, inputs, tokens.shape[1])
        got, _ = decoder.step(tokens, decoder.empty_cache(batch, tokens.shape[1]), mask, extra)
        keep = defined_positions(mask)
        row = _row(source, inputs, name, got, tolerance, keep, precision)
        cases.append({"phase": "prefill", "batch": batch, "sequence": tokens.shape[1], **row})
    return cases


def _decode_cases(source, decoder, name, tolerance, seed, precision) -> list[dict]:
    """A prompt, then :data:`DECODE_STEPS` teacher-forced single-token steps on the cache,
    each against the rows of one eager pass over the whole sequence."""
    token_input = decoder.token_input
    length = DECODE_PROMPT + DECODE_STEPS + 2
    limit = source.info.get("max_positions")
    if limit:  # within the model's positions (the prompt shrinks to fit)
        length = min(length, limit)
    inputs = source.inputs(DECODE_BATCH, length, seed=seed + 7)
    tokens, extra = _split(source, decoder, inputs)
    prompt = min(DECODE_PROMPT, tokens.shape[1] - DECODE_STEPS)
    cache = decoder.empty_cache(DECODE_BATCH, prompt + DECODE_STEPS)
    whole = {k: v for k, v in inputs.items()}
    whole[token_input] = inputs[token_input][:, : prompt + DECODE_STEPS]
    if decoder.mask_input is not None:
        whole[decoder.mask_input] = inputs[decoder.mask_input][:, : prompt + DECODE_STEPS]
    eager = eager_outputs(source, whole, precision)  # causal: row t is the prefix's last row
    cases = []
    for step in range(DECODE_STEPS + 1):
        start, end = (0, prompt) if step == 0 else (prompt + step - 1, prompt + step)
        mask = _mask(decoder, inputs, end)
        got, cache = decoder.step(tokens[:, start:end], cache, mask, extra)
        keep = defined_positions(mask, start)
        row = _row(source, whole, name, got, tolerance, keep, precision, slice(start, end), eager)
        phase = "prefill" if step == 0 else "decode"
        cases.append(
            {"phase": phase, "batch": DECODE_BATCH, "past": start, "new": end - start, **row}
        )
        logger.info("cache parity %s past=%d: max_abs=%.3g", phase, start, row["max_abs_err"])
    return cases


def _phase_summaries(cases: list[dict]) -> dict:
    """Per phase (prefill, decode): the largest errors, whether all passed, how many cases."""
    summary = {}
    for phase in ("prefill", "decode"):
        rows = [c for c in cases if c["phase"] == phase]
        summary[phase] = {
            "max_abs_err": max(r.get("max_abs_err", float("inf")) for r in rows),
            "max_rel_err": max(r.get("max_rel_err", float("inf")) for r in rows),
            "passed": all(r["passed"] for r in rows),
            "cases": len(rows),
        }
        for key in BRACKET_KEYS:
            if any(key in r for r in rows):
                summary[phase][key] = max(r.get(key, 0.0) for r in rows)
    return summary


def _output(name: str, phases: list[dict], cases: list[dict], tolerance: Tolerance) -> dict:
    """The output's entry over both phases, as the uncached parity reports it."""
    return {
        "name": name,
        "max_abs_err": max(s["max_abs_err"] for s in phases),
        "max_rel_err": max(s["max_rel_err"] for s in phases),
        "tolerance": ruling(cases, tolerance),
        "passed": all(s["passed"] for s in phases),
        **{
            key: max(s[key] for s in phases if key in s)
            for key in BRACKET_KEYS
            if any(key in s for s in phases)
        },
    }


def _rows(source, decoder, cases, tolerance, precision, seed) -> dict | None:
    """The rows check (:func:`check_row_parity`), bounded by the decode steps' rule where the
    kernels quantize activations."""
    from tfgraph.verify.row_parity import ROW_RULE, check_row_parity, row_tolerance

    allowed = _decode_allowed(source, cases)
    rows = check_row_parity(source, decoder, row_tolerance(tolerance, precision, allowed), seed)
    if rows is not None and allowed is not None:
        rows.update(rule=ROW_RULE, decode_allowed=allowed)
    return rows


def _decode_allowed(source: ModelSource, cases: list[dict]) -> float | None:
    """The largest error the decode steps' rule allowed, for an artifact whose kernels
    quantize activations (the bound of its rows: :func:`row_tolerance`); None otherwise."""
    from tfgraph.exporters.ort.weights.activations import quantizes_activations

    if not quantizes_activations(source):
        return None
    found = [c["allowed"] for c in cases if c["phase"] == "decode" and "allowed" in c]
    return max(found) if found else None


GREEDY_STEPS = 32


def greedy_against_eager(source: ModelSource, decoder: CachedDecoder, seed=0) -> tuple:
    """The artifact's greedy tokens for two prompts from the source's inputs (an
    encoder-decoder's feed its encoder), :data:`GREEDY_STEPS` steps within the model's
    positions, and eager fp32's choice on each of their prefixes (:func:`forced_choices`):
    (artifact tokens, eager tokens, prompts, extra feeds, steps)."""
    from tfgraph.runtime import GenerationConfig, generate
    from tfgraph.verify.generation_parity import encoder_inputs

    inputs = source.inputs(2, 6, seed=seed + 13)
    ids = inputs[decoder.token_input].numpy()
    prompts = [ids[0].tolist(), ids[1, :3].tolist()]
    # a vision-language decoder's image features go with the prompt (merged there only)
    # (with the encoder's: Mllama's features feed its cross K/V encoder)
    features = [p for p in decoder._all_inputs() if p.role in contract.PROMPT_ROLES]
    extra = {p.name: inputs[p.name].numpy() for p in features}
    if decoder.seq2seq:  # the prompts feed the encoder; the decoder starts from token 0
        extra, prompts = encoder_inputs(decoder, prompts), [[0], [0]]
    steps = GREEDY_STEPS
    limit = source.info.get("max_positions")
    if limit:
        steps = min(steps, limit - max(len(p) for p in prompts))
    got = generate(decoder, prompts, GenerationConfig(max_new_tokens=steps), extra=extra).tokens
    return got, forced_choices(source, decoder, prompts, got, extra), prompts, extra, steps


def forced_choices(source: ModelSource, decoder: CachedDecoder, prompts, tokens, extra) -> list:
    """The token ``source`` (eager) picks greedily on each prefix of ``tokens`` (the artifact's
    greedy run), in one teacher-forced pass: equal to ``tokens`` up to where free-running
    eager greedy would part from them, exactly."""
    from tfgraph.verify.generation_parity import forced_logits

    steps = len(tokens[0])
    logits = forced_logits(source, decoder, prompts, tokens, steps, extra=extra)
    return logits.argmax(-1).T.tolist()


def greedy_in_precision(source: ModelSource, decoder: CachedDecoder, precision: str, seed=0):
    """Greedy tokens of the artifact in ``precision`` against eager fp32 and eager in that
    precision, each choosing on the artifact's own prefixes (:func:`forced_choices`),
    :data:`GREEDY_STEPS` steps for two prompts: how many agree. Reported, not judged: a
    random model's near ties decide tokens in fp16."""
    import dataclasses

    from tfgraph.precision.islands import TORCH_TYPES

    got, fp32, prompts, extra, steps = greedy_against_eager(source, decoder, seed)
    low_source = dataclasses.replace(source, module=source.converted(TORCH_TYPES[precision]))
    low = forced_choices(low_source, decoder, prompts, got, extra)

    def agree(a, b) -> int:
        return sum(
            x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=False)
        )

    total = sum(len(r) for r in got)
    return {
        "steps": steps,
        "tokens": total,
        "equal_to_fp32_eager": agree(got, fp32),
        f"equal_to_{precision}_eager": agree(got, low),
        f"{precision}_eager_equal_to_fp32_eager": agree(low, fp32),
    }
