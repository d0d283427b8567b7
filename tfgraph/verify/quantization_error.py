"""How far a weight-quantized model is from the fp32 one (the ``weights.error_vs_fp32`` of the
report): logits on the parity inputs, and the artifact's greedy tokens judged by fp32 eager.

The greedy figure costs one eager pass, whatever the number of tokens: the artifact decodes
:data:`GREEDY_TOKENS` greedily through its cache, then fp32 eager runs once over the prompt
and those tokens (teacher forcing) and gives, at every step, the token it would have chosen
on the artifact's own prefix. ``greedy_first_difference`` is where free-running fp32 greedy
would part from the artifact (the prefixes are equal up to there); ``greedy_agreement``
counts the steps whose top token fp32 shares on the artifact's prefix (llama.cpp's "same top
token"). Recomputing fp32 greedy instead took one eager pass per token: 64 passes of a
streamed 120M checkpoint, 80–330 s of a 150–540 s export.
"""

from __future__ import annotations

import numpy as np

from tfgraph import contract

GREEDY_TOKENS = 64
PROMPT_TOKENS = 8


def quantization_error(source, reference, model_file, shapes) -> dict:
    """How far the dequantized model is from the fp32 one: the largest logits difference on
    the parity inputs (the first shape for a streamed checkpoint, whose every eager pass
    reads the whole checkpoint), and for a cached artifact its greedy tokens against fp32
    eager's choices on the same prefixes (module docstring)."""
    name = source.output_names[0]
    worst, scale = 0.0, 0.0
    if source.binder is not None:
        shapes = shapes[:1]
    for i, (batch, seq) in enumerate(shapes):
        inputs = source.inputs(batch, seq, seed=i)
        want = source.eager(inputs)[name].float().numpy()
        got = reference.eager(inputs)[name].float().numpy()
        worst = max(worst, float(np.abs(got - want).max()))
        scale = max(scale, float(np.abs(want).max()))
    out = {"max_logits_err": worst, "max_logits_rel_err": worst / scale if scale else worst}
    if model_file is None:
        return out
    return {**out, **greedy_error(source, model_file)}


def greedy_error(source, model_file) -> dict:
    """The artifact's greedy tokens (one 8-token prompt) against fp32 eager's top token on
    each of its prefixes, in one teacher-forced eager pass."""
    from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner
    from tfgraph.verify.generation_parity import encoder_inputs, forced_logits

    decoder = CachedDecoder(open_runner(model_file))
    inputs = source.inputs(1, PROMPT_TOKENS, seed=11)
    prompts = inputs[decoder.token_input].numpy().tolist()
    # a vision-language decoder's image features go with the prompt (merged there only)
    # (with the encoder's: Mllama's features feed its cross K/V encoder)
    features = [p for p in decoder._all_inputs() if p.role in contract.PROMPT_ROLES]
    start, extra = prompts, {p.name: inputs[p.name].numpy() for p in features}
    if decoder.seq2seq:  # the prompt feeds the encoder; the decoder starts from token 0
        start, extra = [[0]], encoder_inputs(decoder, prompts)
    steps = GREEDY_TOKENS
    limit = source.info.get("max_positions")
    if limit:
        steps = min(steps, limit - len(start[0]))
    config = GenerationConfig(max_new_tokens=steps)
    run = generate(decoder, start, config, extra=extra, keep_logits=True)
    tokens = run.tokens
    steps = len(tokens[0])
    logits = forced_logits(source, decoder, start, tokens, steps, extra=extra)
    same = [int(logits[t, 0].argmax()) == tokens[0][t] for t in range(steps)]
    diff = max(
        float(np.abs(np.asarray(g[0], np.float64) - w[0]).max())
        for g, w in zip(run.step_logits, logits, strict=True)
    )
    return {
        "greedy_tokens": steps,
        "greedy_agreement": sum(same),
        "greedy_first_difference": same.index(False) if False in same else None,
        "greedy_max_logits_err": diff,  # on the artifact's prefixes: its logits against fp32's
        "greedy_of": "the artifact's greedy tokens; fp32 eager's top token on each of their "
        "prefixes (one teacher-forced pass)",
    }
