"""``tfgraph engine DIR``: build TensorRT engines for a ``--target tensorrt`` artifact."""

from __future__ import annotations

from tfgraph.errors import TfgraphError


def add_parser(sub):
    p = sub.add_parser(
        "engine", help="build TensorRT engines for an artifact exported with --target tensorrt"
    )
    p.add_argument("path", help="artifact directory (exported with --target tensorrt[@X.Y])")
    p.add_argument("--batch", default="1,1,8", help="MIN,OPT,MAX batch (default 1,1,8)")
    p.add_argument(
        "--sequence", default="1,128,1024", help="MIN,OPT,MAX new tokens (default 1,128,1024)"
    )
    p.add_argument("--capacity", type=int, default=2048, help="KV positions (default 2048)")
    p.add_argument("--workspace-gib", type=float, default=4.0, help="builder workspace (GiB)")
    p.set_defaults(func=run)


def run(args) -> int:
    from tfgraph.exporters.tensorrt.engines import ProfileOptions, build_engine

    def triple(text: str, what: str) -> tuple[int, int, int]:
        try:
            lo, opt, hi = (int(v) for v in text.split(","))
        except ValueError:
            raise TfgraphError(
                f"--{what} takes MIN,OPT,MAX (three integers), got '{text}'"
            ) from None
        return lo, opt, hi

    options = ProfileOptions(
        batch=triple(args.batch, "batch"),
        sequence=triple(args.sequence, "sequence"),
        capacity=args.capacity,
    )
    engine = build_engine(args.path, options, workspace_gib=args.workspace_gib)
    print(f"wrote {engine}")
    return 0
