"""``tfgraph generate PATH``: generate tokens with a KV-cached artifact."""

from __future__ import annotations

import sys
import time

from tfgraph import contract
from tfgraph.cli.run import load_inputs, parse_ids
from tfgraph.errors import TfgraphError


def add_parser(sub):
    p = sub.add_parser("generate", help="generate tokens with a KV-cached artifact")
    p.add_argument("path", help="artifact directory exported with --kv-cache")
    p.add_argument(
        "--input-ids",
        action="append",
        help='prompt token ids, e.g. "1 2 3"; repeat for a batch (left-padded)',
    )
    p.add_argument("--text", action="append", help="prompt text (the artifact's tokenizer)")
    p.add_argument(
        "--image",
        action="append",
        metavar="FILE",
        help="vision-language artifacts: an image for each --text (the model's own processor)",
    )
    p.add_argument(
        "--inputs",
        metavar="FILE.npz",
        help="encoder inputs that are not token ids (a speech model's input_features), by name",
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0: off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--eos-token-id", type=int, default=None)
    p.add_argument("--pad-token-id", type=int, default=0)
    p.add_argument(
        "--decoder-start-token-id",
        type=int,
        default=0,
        help="encoder-decoder models: the first decoder token",
    )
    p.add_argument("--provider", action="append", default=None, help="cpu (default) or cuda")
    spec = p.add_argument_group("speculative decoding (one prompt; docs/speculative.md)")
    spec.add_argument(
        "--draft",
        metavar="DRAFT_DIR",
        help="a smaller KV-cached artifact (same tokenizer) drafts the tokens the model verifies",
    )
    spec.add_argument(
        "--prompt-lookup",
        nargs="?",
        const=3,
        type=int,
        metavar="N",
        help="draft by looking up the last N tokens (default 3) earlier in the prompt + output",
    )
    spec.add_argument(
        "--speculative-k", type=int, default=4, metavar="K", help="tokens drafted per step"
    )
    spec.add_argument(
        "--draft-min-p",
        type=float,
        default=0.0,
        metavar="P",
        help="stop drafting where the draft's top probability is below P (greedy)",
    )
    spec.add_argument(
        "--adaptive-k",
        action="store_true",
        help="adapt k: +1 after a step that accepts all, -1 after one that accepts under half",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner

    # a draft's session and the model's take turns: neither spin-waits (Session's spinning)
    spinning = args.draft is None
    decoder = CachedDecoder(open_runner(args.path, providers=args.provider, spinning=spinning))
    tokenizer, extra = None, {}
    inputs = decoder._all_inputs()  # a cross-attention VLM's features feed its encoder
    if any(p.role == contract.IMAGE_FEATURES for p in inputs):  # a VLM: the model's processor
        from tfgraph.runtime.vision_language import ImagePrompts

        images = ImagePrompts(args.path, providers=args.provider)
        if args.text is None:
            raise TfgraphError('give a prompt: --text "…" (with --image FILE)')
        prompts, extra = images.prepare(args.text, args.image)
        tokenizer = images.tokenizer
    elif args.image:
        raise TfgraphError(f"'{args.path}' is not a vision-language artifact: --image needs one")
    elif args.text is not None:
        from tfgraph.runtime.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.path)
        prompts = [tokenizer(t)["input_ids"] for t in args.text]
    elif args.input_ids:
        prompts = [parse_ids(t, "--input-ids") for t in args.input_ids]
    elif args.inputs and decoder.seq2seq:  # a speech encoder-decoder: features feed the encoder
        prompts = []
    else:
        raise TfgraphError('give a prompt: --input-ids "1 2 3" (or --text with a tokenizer)')
    extra = {**extra, **load_inputs(args.inputs, decoder.session.signature, decoder.encoder)}
    if decoder.seq2seq and not prompts:
        batch = next(iter(extra.values())).shape[0]
        prompts = [[args.decoder_start_token_id]] * batch
    elif decoder.seq2seq:  # encoder-decoder: prompts feed the encoder
        from tfgraph.runtime.generate import seq2seq_prompts

        prompts, feeds = seq2seq_prompts(
            decoder, prompts, args.pad_token_id, args.decoder_start_token_id
        )
        extra = {**extra, **feeds}
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=args.eos_token_id,
        pad_token_id=args.pad_token_id,
    )
    start = time.perf_counter()

    def progress(done: int) -> None:
        if done % 16 == 0 or done == args.max_new_tokens:
            print(f"[{done}/{args.max_new_tokens}] tokens …", file=sys.stderr, flush=True)

    if args.draft is not None or args.prompt_lookup is not None:
        result = _speculative(args, decoder, prompts, config, extra)
    else:
        result = generate(decoder, prompts, config, extra=extra, progress=progress)
    seconds = time.perf_counter() - start
    for row, tokens in enumerate(result.tokens):
        text = " ".join(map(str, tokens))
        if tokenizer is not None:
            text = tokenizer.decode(tokens)
        print(f"[{row}] {text}")
    total = sum(len(t) for t in result.tokens)
    print(f"{total} tokens in {seconds:.2f} s ({total / seconds:.1f} tokens/s)", file=sys.stderr)
    return 0


def _speculative(args, decoder, prompts, config, extra):
    """``--draft`` / ``--prompt-lookup``: one prompt through the speculative loop; prints the
    acceptance rate and the tokens per verify step."""
    from tfgraph.runtime import CachedDecoder, Generation, open_runner
    from tfgraph.runtime.drafters import DraftModel, PromptLookup
    from tfgraph.runtime.speculative import DraftLength, SpeculativeStats
    from tfgraph.runtime.speculative_loop import speculative_generate

    if args.draft is not None and args.prompt_lookup is not None:
        raise TfgraphError("give --draft DRAFT_DIR or --prompt-lookup, not both")
    if len(prompts) != 1 or extra:
        raise TfgraphError("speculative decoding takes one text prompt; give a single --text")
    if args.draft is not None:
        draft = CachedDecoder(open_runner(args.draft, providers=args.provider, spinning=False))
        drafter = DraftModel(draft, decoder, seed=args.seed, min_probability=args.draft_min_p)
    else:
        drafter = PromptLookup(max_ngram=args.prompt_lookup)
    length = DraftLength(k=args.speculative_k, adaptive=args.adaptive_k)
    stats = SpeculativeStats()
    tokens = speculative_generate(decoder, prompts[0], drafter, config, length=length, stats=stats)
    print(stats.summary(), file=sys.stderr)
    return Generation([tokens], prompt_lengths=[len(prompts[0])])
