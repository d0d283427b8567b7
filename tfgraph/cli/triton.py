"""``tfgraph triton DIR -o REPO``: a Triton Inference Server model repository from an
artifact; ``tfgraph tritonserver REPO``: the server environment's ``tritonserver`` serving it
(``python -m tfgraph.serving.install`` installs that environment)."""

from __future__ import annotations

import shlex

from tfgraph.cli.inflight_flags import add_inflight_flags
from tfgraph.cli.output import table
from tfgraph.errors import TfgraphError

INSTALL_COMMAND = "python -m tfgraph.serving.install"


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
    add_inflight_flags(p, scope="in-flight batching", copied=True)
    p.add_argument(
        "--batching",
        choices=("inflight", "static"),
        help="the generation model's batching (default: in flight where the artifact allows, "
        "else the requests that arrive together)",
    )
    p.set_defaults(func=run)
    add_server_parser(sub)


def add_server_parser(sub):
    p = sub.add_parser(
        "tritonserver",
        help="run tritonserver (the server environment's) on a repository tfgraph triton wrote",
    )
    p.add_argument("repository", nargs="?", help="the model repository (tfgraph triton -o's)")
    p.add_argument(
        "--model-repository", dest="model_repository", help="the same, as tritonserver spells it"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001)")
    p.add_argument("--metrics-port", type=int, default=8002, help="metrics port (default 8002)")
    p.set_defaults(func=run_server)


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
        prefill_chunk=args.prefill_chunk,
        prefix_cache_mb=args.prefix_cache_mb,
        speculative=args.speculative,
        speculative_k=args.speculative_k,
    )
    print(f"wrote Triton model repository {args.output}/")
    rows = [[m.name, m.backend, m.kind, "; ".join(m.notes)] for m in models]
    print(table(rows, ["model", "backend", "kind", "notes"]))
    serve = next((m.name for m in models if m.kind == "generate"), None)
    if serve:
        repo = shlex.quote(str(args.output))
        print(f"serve: tfgraph tritonserver {repo} (stream from '{serve}')")
        print(
            f"  (once, the server environment: {INSTALL_COMMAND}; in NVIDIA's Triton "
            f"container: tritonserver --model-repository {repo})"
        )
    return 0


def run_server(args) -> int:
    from pathlib import Path

    from tfgraph.interrupts import unwinding
    from tfgraph.runtime.serving.install import find_tritonserver
    from tfgraph.runtime.serving.launcher import loadable_models, serve_foreground

    if (args.repository is None) == (args.model_repository is None):
        raise TfgraphError("give the repository once: tfgraph tritonserver REPO")
    repository = Path(args.repository or args.model_repository)
    if not repository.is_dir():
        raise TfgraphError(f"model repository '{repository}' is not a directory")
    install = find_tritonserver()  # one line naming the install command when missing
    load, skipped = loadable_models(repository, install)
    for name, why in skipped.items():
        print(f"not loading {name}: {why} (the Triton container has it)")
    if not load:
        raise TfgraphError(f"'{repository}' holds no model this tritonserver can load")
    print(
        f"tritonserver on {args.host}: HTTP {args.http_port}, gRPC {args.grpc_port}, metrics "
        f"{args.metrics_port}; loading {', '.join(load)}; Ctrl-C stops it",
        flush=True,
    )
    with unwinding():  # SIGTERM too stops the server and its stubs
        code = serve_foreground(
            repository,
            host=args.host,
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            metrics_port=args.metrics_port,
            models=load,
        )
    if code != 0:
        raise TfgraphError(f"tritonserver exited with code {code}; its log is above")
    return 0
