"""``tfgraph triton DIR -o REPO``: a Triton Inference Server model repository from an
artifact."""

from __future__ import annotations

from tfgraph.cli.output import table


def add_parser(sub):
    p = sub.add_parser(
        "triton", help="write a Triton Inference Server model repository from an artifact"
    )
    p.add_argument("path", help="artifact directory (tfgraph export's)")
    p.add_argument("-o", "--output", required=True, help="repository directory to write")
    p.add_argument("--name", help="the engine model's name (default: the artifact directory's)")
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=8,
        help="max_batch_size of a batchable (uncached) engine; 0 turns batching off",
    )
    p.add_argument(
        "--max-sequence",
        type=int,
        help="capacity of a shared KV buffer held as Triton state (default: the model's "
        "max positions, else 2048)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=16,
        help="the most generation requests decoded in one batch (and the default --slots)",
    )
    p.add_argument(
        "--slots",
        type=int,
        help="cache slots of the generation model's in-flight batching: requests decoded at "
        "once, each joining at the next step in a free slot (default: --concurrency)",
    )
    p.add_argument(
        "--slot-capacity",
        type=int,
        help="positions per slot: prompt + new tokens of one request (default: the model's "
        "max positions, at most 1024)",
    )
    p.add_argument(
        "--batching",
        choices=("inflight", "static"),
        help="the generation model's batching (default: in flight where the artifact allows, "
        "else the requests that arrive together)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from tfgraph.runtime.serving import write_repository

    models = write_repository(
        args.path,
        args.output,
        name=args.name,
        max_batch_size=args.max_batch_size,
        max_sequence=args.max_sequence,
        concurrency=args.concurrency,
        slots=args.slots,
        slot_capacity=args.slot_capacity,
        batching=args.batching,
    )
    print(f"wrote Triton model repository {args.output}/")
    rows = [[m.name, m.backend, m.kind, "; ".join(m.notes)] for m in models]
    print(table(rows, ["model", "backend", "kind", "notes"]))
    serve = next((m.name for m in models if m.kind == "generate"), None)
    if serve:
        print(f"serve: tritonserver --model-repository {args.output} (stream from '{serve}')")
    return 0
