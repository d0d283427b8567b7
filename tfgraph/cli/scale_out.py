"""``tfgraph serve DIR --replicas N``: N ``tfgraph serve`` replicas behind haproxy
(:mod:`tfgraph.runtime.serving.replicas`); what it prints, and its life until Ctrl-C."""

from __future__ import annotations

from pathlib import Path

from tfgraph.errors import TfgraphError


def model_name(args) -> str:
    return args.name or Path(args.path).resolve().name  # one name for every replica


_OWN = {"help", "host", "port", "threads", "replicas", "balancer", "balancer_config", "verbose"}


def serve_args(args) -> list[str]:
    """The ``tfgraph serve`` flags each replica gets: every one of this command's own that is
    not the default (read from the serve parser, so a flag added there is passed on), but the
    address, threads and replica flags; and one model name for every replica."""
    from tfgraph.cli import build_parser

    out = ["--name", model_name(args)]
    for action in build_parser().commands["serve"]._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in _OWN | {"name"} or value is None:
            continue
        flag = action.option_strings[-1]
        if isinstance(value, bool):
            out += [flag] if value and value != action.default else []
        elif isinstance(value, list):  # action="append"
            out += [a for v in value for a in (flag, str(v))]
        elif value != action.default:
            out += [flag, str(value)]
    return out


def run_replicas(args) -> int:
    from tfgraph.cli.output import progress
    from tfgraph.interrupts import unwinding
    from tfgraph.progress import listening
    from tfgraph.runtime.serving.replicas import ReplicaSet, replica_threads

    if args.replicas < 1:
        raise TfgraphError(f"--replicas {args.replicas}: give 1 or more")
    if args.threads is not None and args.threads < 1:
        raise TfgraphError(f"--threads {args.threads}: give 1 or more")
    replicas = ReplicaSet(
        Path(args.path), args.replicas, host=args.host, port=args.port, threads=args.threads,
        serve_args=serve_args(args), config=args.balancer_config, balancer=args.balancer,
    )  # fmt: skip
    with unwinding(), listening(progress(2)):  # SIGTERM unwinds as Ctrl-C does: all stop
        with replicas:
            ports = [m.port for m in replicas.members]
            threads = replica_threads(args.replicas, args.threads)
            print(
                f"serving '{model_name(args)}' on {replicas.url}/v1 through {args.balancer}: "
                f"{args.replicas} replicas on ports {ports[0]}..{ports[-1]}, {threads} threads "
                "each; Ctrl-C stops them all",
                flush=True,
            )
            print(
                f"{args.balancer} configuration: {replicas.config} "
                f"(reuse: {args.balancer} -db -f {replicas.config})",
                flush=True,
            )
            replicas.supervise()
    return 0
