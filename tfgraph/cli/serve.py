"""``tfgraph serve DIR``: an OpenAI-compatible server (``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``) over a KV-cached artifact, its requests batched in flight."""

from __future__ import annotations

from tfgraph.cli.inflight_flags import add_inflight_flags
from tfgraph.errors import TfgraphError


def add_parser(sub):
    p = sub.add_parser(
        "serve",
        help="serve a KV-cached artifact over the OpenAI API (completions, chat), in flight",
    )
    p.add_argument("path", help="artifact directory (tfgraph export --kv-cache's)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--max-batch",
        type=int,
        default=16,
        help="requests decoded at once: the in-flight batcher's cache slots (default 16)",
    )
    p.add_argument(
        "--slot-capacity",
        type=int,
        help="positions per slot, prompt + new tokens of one request (default: the model's "
        "max positions, at most 1024)",
    )
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: all)")
    add_inflight_flags(p)
    p.add_argument("--name", help="the model's name in the API (default: the directory's)")
    p.add_argument("--provider", action="append", default=None, help="cpu (default) or cuda")
    p.add_argument(
        "--replicas", type=int, default=1,
        help="N servers on the N ports after --port, behind a load balancer on --port; "
        "--threads is then each one's (default: the cores shared out); docs/scale-out.md",
    )  # fmt: skip
    p.add_argument(
        "--balancer", default="haproxy", choices=["haproxy"],
        help="the load balancer of --replicas, from your distribution (default haproxy)",
    )  # fmt: skip
    p.add_argument(
        "--balancer-config",
        help="where --replicas writes the balancer's configuration, kept for reuse "
        "(default ./haproxy-tfgraph-PORT.cfg)",
    )
    p.set_defaults(func=run)


def _needs_framework() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise TfgraphError(
            f"tfgraph serve needs FastAPI and uvicorn ({exc.name} is missing): "
            "pip install 'tfgraph[serve]'"
        ) from None


def run(args) -> int:
    from pathlib import Path

    _needs_framework()
    if args.replicas != 1:  # N servers behind a load balancer
        from tfgraph.cli.scale_out import run_replicas

        return run_replicas(args)
    from tfgraph.runtime.serving.openai_app import bound_socket, create_app, open_engine, server

    if args.max_batch < 1 or (args.slot_capacity is not None and args.slot_capacity < 2):
        raise TfgraphError("--max-batch must be >= 1 and --slot-capacity >= 2")
    if args.prefill_chunk < 0 or args.prefix_cache_mb < 0:
        raise TfgraphError("--prefill-chunk and --prefix-cache-mb must be >= 0 (0: off)")
    sock = bound_socket(args.host, args.port)  # before the model loads: a busy port fails fast
    engine, tokenizer = open_engine(
        args.path,
        slots=args.max_batch,
        capacity=args.slot_capacity,
        threads=args.threads,
        providers=args.provider,
        prefill_chunk=args.prefill_chunk,
        prefix_cache_mb=args.prefix_cache_mb,
        speculative=args.speculative,
        speculative_k=args.speculative_k,
    )
    name = args.name or Path(args.path).resolve().name
    host = f"[{args.host}]" if ":" in args.host else args.host
    port = sock.getsockname()[1]
    chat = "chat template" if getattr(tokenizer, "chat_template", None) else "no chat template"
    text = "tokenizer" if tokenizer is not None else "no tokenizer: token ids only"
    print(
        f"serving '{name}' on http://{host}:{port}/v1 ({engine.slots} slots x "
        f"{engine.capacity} positions, in flight; {text}, {chat}); Ctrl-C stops it",
        flush=True,
    )
    app = create_app(engine, tokenizer, name)
    try:
        server(app, verbose=args.verbose).run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
    return 0
