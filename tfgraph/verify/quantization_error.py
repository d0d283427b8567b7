"""How far a weight-quantized model is from the fp32 one (the ``weights.error_vs_fp32`` of the
report): logits on the parity inputs, and greedy tokens of both eager models."""

from __future__ import annotations

import numpy as np

GREEDY_TOKENS = 64
# a checkpoint streamed from disk reads every weight once per eager token (twice: fp32 and
# dequantized); past a GiB of weights the comparison runs over fewer tokens (the report says)
BIG_CHECKPOINT_BYTES = 1 << 30
BIG_GREEDY_TOKENS = 8


def quantization_error(source, reference, model_file, shapes) -> dict:
    """How far the dequantized model is from the fp32 one: the largest logits difference on
    the parity inputs, and for a cached artifact the greedy tokens of both eager models over
    :data:`GREEDY_TOKENS` steps (how many agree, where they part). A streamed checkpoint is
    compared on the first parity shape, over :data:`BIG_GREEDY_TOKENS` past a GiB, with the
    artifact's cached tokens standing for the dequantized model's."""
    name = source.output_names[0]
    worst, scale = 0.0, 0.0
    if source.binder is not None:
        shapes = shapes[:1]  # streamed: every eager pass reads the whole checkpoint
    for i, (batch, seq) in enumerate(shapes):
        inputs = source.inputs(batch, seq, seed=i)
        want = source.eager(inputs)[name].float().numpy()
        got = reference.eager(inputs)[name].float().numpy()
        worst = max(worst, float(np.abs(got - want).max()))
        scale = max(scale, float(np.abs(want).max()))
    out = {"max_logits_err": worst, "max_logits_rel_err": worst / scale if scale else worst}
    if model_file is None:
        return out
    from tfgraph.runtime import CachedDecoder, open_runner
    from tfgraph.verify.generation_parity import eager_greedy, encoder_inputs

    decoder = CachedDecoder(open_runner(model_file))
    tokens = source.inputs(1, 8, seed=11)[decoder.token_input].numpy()
    prompts = tokens.tolist()
    steps = GREEDY_TOKENS
    if source.info.get("checkpoint_bytes", 0) > BIG_CHECKPOINT_BYTES:
        steps = BIG_GREEDY_TOKENS
    limit = source.info.get("max_positions")
    if limit:
        steps = min(steps, limit - (1 if decoder.seq2seq else tokens.shape[1]))
    extra = encoder_inputs(decoder, prompts) if decoder.seq2seq else {}
    fp32, _ = eager_greedy(source, decoder, prompts, extra, steps)
    if source.binder is not None:
        # a streamed checkpoint: the artifact's own cached tokens stand for the dequantized
        # model (parity just proved them equal to it) — one streamed eager run, not two
        from tfgraph.runtime import GenerationConfig, generate

        deq = generate(decoder, prompts, GenerationConfig(max_new_tokens=steps), extra=extra).tokens
        out["greedy_of"] = "the artifact (cached) against fp32 eager"
    else:
        deq, _ = eager_greedy(reference, decoder, prompts, extra, steps)
    same = [a == b for a, b in zip(fp32[0], deq[0], strict=True)]
    out["greedy_tokens"] = steps
    out["greedy_agreement"] = sum(same)
    out["greedy_first_difference"] = same.index(False) if False in same else None
    return out
