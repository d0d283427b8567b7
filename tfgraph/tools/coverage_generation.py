"""The coverage matrix's token check: a decoder's KV-cached export, greedy, against Hugging
Face.

:func:`greedy_vs_hf` generates :data:`NEW_TOKENS` greedy tokens for the two left-padded
:data:`PROMPTS` with :func:`tfgraph.runtime.generate` on the cached artifact and compares
them with Hugging Face ``model.generate`` under a plain greedy config (no processors), or with
eager greedy decoding by full recompute where ``generate`` post-processes (Whisper) or fails
(Dory, Pop2Piano) or disagrees with the model's own uncached forward (RWKV at batch > 1). An
export without an ``attention_mask`` input (VibeVoice's, xLSTM's) generates each prompt alone:
left padding would be attended; so does its reference. :mod:`tfgraph.tools.coverage` measures
each row with it.
"""

from __future__ import annotations

from pathlib import Path

NEW_TOKENS = 32
PROMPTS = ([5, 17, 42], [7, 3, 99, 150, 23, 11, 64])
# the encoder input's dynamic axes: 40 frames of features; a second of 16 kHz raw audio,
# which a feature extractor's strided convolutions (Moonshine's: 384 samples a frame) need
_PROBE_LENGTHS = {"batch": 2, "samples": 16000}


def greedy_vs_hf(work: Path, model, kind: str) -> dict:
    """The export's greedy tokens against the reference's (module doc): whether they agree,
    the reference, and where they part."""
    from tfgraph.runtime import CachedDecoder, GenerationConfig, Session

    decoder = CachedDecoder(Session(work / "cached"))
    hf_config = _plain_greedy_config()
    ours = GenerationConfig(max_new_tokens=NEW_TOKENS, pad_token_id=0)
    # the artifact decides: an audio or vision LM that transformers lists among the seq2seq
    # models (Qwen2-Audio, Voxtral) traces, from token ids alone, to a decoder-only graph
    if kind == "causal-lm" or not decoder.seq2seq:
        got, want, reference = _causal_tokens(decoder, model, hf_config, ours)
    else:
        got, want, reference = _seq2seq_tokens(decoder, model, hf_config, ours)
    equal = got == want
    result = {"tokens_equal": equal, "tokens_reference": reference}
    if decoder.mask_input is None and len({len(p) for p in PROMPTS}) > 1:
        result["tokens_note"] = NO_MASK_NOTE
    if not equal:
        result["tokens_reason"] = _difference(got, want)
    return result


def _plain_greedy_config():
    """Hugging Face's generation config for :data:`NEW_TOKENS` plain greedy tokens."""
    import transformers

    return transformers.GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        num_beams=1,
        pad_token_id=0,
        eos_token_id=None,
        # plain greedy: none of the model's own processors (BART forces EOS last, Whisper
        # suppresses tokens); unset fields would be taken from model.generation_config
        forced_eos_token_id=None,
        forced_bos_token_id=None,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        no_repeat_ngram_size=0,
        repetition_penalty=1.0,
        bad_words_ids=None,
        forced_decoder_ids=None,
    )


def _causal_tokens(decoder, model, hf_config, ours) -> tuple[list, list, str]:
    """A decoder-only export's tokens, the reference's and what the reference was."""
    from tfgraph.runtime.generate import left_pad

    prompts = [list(p) for p in PROMPTS]
    got = _generate_rows(decoder, prompts, ours)
    # without a mask input each prompt went alone: so does the reference (a model that
    # takes no mask, xLSTM's, reads left pads as tokens, in eager as in the export)
    alone = decoder.mask_input is None and len({len(p) for p in prompts}) > 1
    batches = [[p] for p in prompts] if alone else [prompts]
    want, references = [], []
    for batch, mine in zip(batches, [[g] for g in got] if alone else [got], strict=True):
        rows, reference = _causal_reference(model, batch, hf_config, mine, left_pad)
        want += rows
        references.append(reference)
    reference = references[0] if len(set(references)) == 1 else "; ".join(references)
    return got, want, reference


def _seq2seq_tokens(decoder, model, hf_config, ours) -> tuple[list, list, str]:
    """An encoder-decoder export's tokens from the start token, the reference's and what the
    reference was: Hugging Face generate, or eager greedy for features or where it fails."""
    import numpy as np
    import torch

    from tfgraph.errors import first_line
    from tfgraph.runtime import generate
    from tfgraph.runtime.generate import left_pad

    reference = "Hugging Face generate"
    start = _start_token(model.config)
    hf_config.decoder_start_token_id = start
    main = decoder.encoder_inputs[0]
    # features, not token ids (speech models such as Pop2Piano and FunASR take ids)
    dtype = decoder.encoder.input_dtype(main)
    takes_features = dtype is not None and dtype.kind == "f"
    if takes_features:
        port = next(p for p in decoder.encoder.signature.inputs if p.name == main)
        dims = [d if isinstance(d, int) else _PROBE_LENGTHS.get(d, 40) for d in port.shape]
        features = np.random.default_rng(0).standard_normal(dims).astype(np.float32)
        extra = {main: features}
        hf_inputs = {main: torch.from_numpy(features)}
    else:
        ids, mask = left_pad([list(p) for p in PROMPTS], 0)
        extra = decoder.encoder_feeds(ids, mask)
        hf_inputs = {"input_ids": torch.from_numpy(ids)}
        if "attention_mask" in extra:
            hf_inputs["attention_mask"] = torch.from_numpy(mask)
    got = generate(decoder, [[start], [start]], ours, extra=extra).tokens
    if takes_features:  # Whisper's generate post-processes (it drops a
        # repeated start token): the reference is eager greedy decoding instead
        want = _eager_greedy(model, hf_inputs, start)
        reference = "eager greedy (the speech model's generate post-processes)"
    else:
        try:
            out = _hf_generate(model, **hf_inputs, generation_config=hf_config)
            want = out[:, 1:].tolist()
        except RuntimeError as exc:  # Pop2Piano's generate wants features: recompute
            want = _eager_greedy(model, hf_inputs, start)
            reference = f"eager greedy ({first_line(exc)})"
    return got, want, reference


def _difference(got: list[list[int]], want: list[list[int]]) -> str:
    """Where two batches of tokens part: the first step at which a row differs, or the rows'
    lengths where one side stopped early or returned more (never an IndexError)."""
    if len(got) != len(want):
        return f"{len(got)} rows generated, {len(want)} in the reference"
    steps = min(min(map(len, got)), min(map(len, want)))
    for i in range(steps):
        if any(g[i] != w[i] for g, w in zip(got, want, strict=True)):
            return f"first different token at step {i}"
    lengths = [len(g) for g in got], [len(w) for w in want]
    return f"the first {steps} tokens agree; row lengths {lengths[0]} vs {lengths[1]} (reference)"


NO_MASK_NOTE = "the export has no attention_mask input: each prompt generated alone, unpadded"


def _generate_rows(decoder, prompts: list[list[int]], config) -> list[list[int]]:
    """Greedy tokens of a decoder-only export. Without an ``attention_mask`` input (VibeVoice
    takes it only through ``**kwargs``, which the trace does not see) a left-padded row would
    attend its pad tokens: prompts of different lengths then go one at a time, as such an
    artifact can only be served."""
    from tfgraph.runtime import generate

    if decoder.mask_input is not None or len({len(p) for p in prompts}) == 1:
        return generate(decoder, prompts, config).tokens
    return [generate(decoder, [p], config).tokens[0] for p in prompts]


def _causal_reference(model, prompts, hf_config, got, left_pad) -> tuple[list, str]:
    """Hugging Face ``generate``'s greedy tokens for left-padded ``prompts``, or eager greedy
    recompute where ``generate`` fails (Dory) or disagrees with the model's own uncached
    forward (RWKV's one-token step broadcasts a (B, C) shift against (B, 1, C) for B > 1)."""
    import torch

    from tfgraph.errors import first_line

    ids, mask = left_pad(prompts, 0)
    ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
    try:
        out = _hf_generate(model, input_ids=ids, attention_mask=mask, generation_config=hf_config)
    except RuntimeError as exc:  # HF's own loop fails: recompute greedily instead
        return _eager_greedy_causal(model, ids, mask), f"eager greedy ({first_line(exc)})"
    want = out[:, ids.shape[1] :].tolist()
    if got != want:
        recomputed = _eager_greedy_causal(model, ids, mask)
        if recomputed != want and got == recomputed:
            return recomputed, (
                "eager greedy (Hugging Face generate differs from its own uncached forward: "
                f"{_difference(want, recomputed)})"
            )
    return want, "Hugging Face generate"


def _start_token(config) -> int:
    """The decoder's start token: the config's, its decoder/text config's, else BOS, else 0
    (GLM-ASR's and MOSS's configs state none at the top level)."""
    configs = [config]
    try:
        configs.append(config.get_text_config(decoder=True))
    except Exception:  # noqa: BLE001 - a config without sub-configs
        pass
    for name in ("decoder_start_token_id", "bos_token_id"):
        for cfg in configs:
            value = getattr(cfg, name, None)
            if isinstance(value, int):
                return value
    return 0


def _eager_greedy_causal(model, ids, mask) -> list[list[int]]:
    """Greedy decoding of a left-padded batch by full recompute of the eager causal LM, with
    the positions ``generate`` derives from the mask."""
    import torch

    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
            logits = model(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
            ).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return ids[:, -NEW_TOKENS:].tolist()


def _eager_greedy(model, inputs: dict, start: int) -> list[list[int]]:
    """Greedy decoding by full recompute of the eager encoder-decoder."""
    import torch

    batch = next(iter(inputs.values())).shape[0]
    ids = torch.full((batch, 1), start, dtype=torch.long)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(**inputs, decoder_input_ids=ids, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    return ids[:, 1:].tolist()


def _hf_generate(model, **kwargs):
    """Hugging Face's side; its own failure is said as such (not tfgraph's)."""
    import torch

    # the model's own generation_config fills fields left at their defaults (BART's
    # forced_eos_token_id): replace it, so that only the plain greedy config applies
    model.generation_config = kwargs.pop("generation_config")
    try:
        with torch.no_grad():
            return model.generate(**kwargs)
    except Exception as exc:
        raise RuntimeError(f"Hugging Face generate failed: {type(exc).__name__}: {exc}") from exc
