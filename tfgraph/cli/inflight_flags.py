"""The in-flight batcher's flags, the same on ``tfgraph serve`` and ``tfgraph triton``: chunked
prefill, prefix caching, speculative decoding (docs/serving.md)."""

from __future__ import annotations

# the engine's and the Triton model's defaults too (openai_engine.py, repository.py; a test
# holds them equal), kept here so that the CLI imports no framework
DEFAULT_PREFILL_CHUNK, DEFAULT_PREFIX_CACHE_MB = 64, 256


def add_inflight_flags(p, scope: str = "", copied: bool = False) -> None:
    """``--prefill-chunk``, ``--prefix-cache-mb``, ``--speculative``, ``--speculative-k`` on
    parser ``p``; ``scope`` starts each help ("in-flight batching": triton's, which also
    batches statically); ``copied``: a draft artifact is copied into the repository."""
    lead = f"{scope}: " if scope else ""
    p.add_argument(
        "--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
        help=f"{lead}prompt tokens prefilled per step, in chunks between the running "
        f"requests' steps; 0: each prompt whole at once (default {DEFAULT_PREFILL_CHUNK})",
    )  # fmt: skip
    p.add_argument(
        "--prefix-cache-mb", type=float, default=DEFAULT_PREFIX_CACHE_MB, metavar="M",
        help=f"{lead}K/V blocks of prompts kept for prompts that start the same, at most M "
        f"MiB (least recently used evicted); 0: off (default {DEFAULT_PREFIX_CACHE_MB})",
    )  # fmt: skip
    p.add_argument(
        "--speculative", metavar="prompt-lookup|DRAFT_DIR",
        help=f"{lead}speculative decoding while at most 2 requests decode: each step verifies "
        "a request's drafts, from prompt lookup or a smaller artifact with the same tokenizer "
        f"({'copied in; ' if copied else ''}default: off)",
    )  # fmt: skip
    p.add_argument(
        "--speculative-k", type=int, default=4, metavar="K", help="drafts per step (default 4)"
    )
