"""``python -m tfgraph``: export, run, generate, bench, inspect, models.

``main(argv) -> int``; the CLI prints, the library logs. Each command is a module here with
``add_parser(sub)`` (its arguments, ``func=run``) and ``run(args) -> int``; what several
commands print is in ``tfgraph.cli.output``. Heavy imports (torch, the exporter, the fuzzer's
hypothesis) happen in the ``run`` functions only.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from tfgraph.cli import (
    bench,
    coverage,
    engine,
    export,
    fuzz,
    generate,
    inspect,
    listing,
    parity,
    run,
    serve,
    triton,
)
from tfgraph.cli.listing import models_table
from tfgraph.errors import TfgraphError

# in `tfgraph --help` order; listing adds `targets` and `models`
COMMANDS = (
    export,
    run,
    coverage,
    generate,
    bench,
    parity,
    engine,
    serve,
    triton,
    inspect,
    fuzz,
    listing,
)

__all__ = ["build_parser", "main", "models_table"]


def build_parser() -> argparse.ArgumentParser:
    from tfgraph import __version__

    parser = argparse.ArgumentParser(
        prog="tfgraph", description="Compile PyTorch transformers to proven ONNX artifacts."
    )
    parser.add_argument("--version", action="version", version=f"tfgraph {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    for p in sub.choices.values():  # every command: -v, last
        p.add_argument("-v", "--verbose", action="store_true", help="per-pass and per-layer detail")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.verbose:  # third-party libraries stay quiet unless something is wrong
        for name in ("onnx_ir", "onnxscript", "torch"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if getattr(args, "provider", "x") is None:
        args.provider = ["cpu"]
    try:
        return args.func(args)
    except TfgraphError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # Ctrl-C; SIGTERM and SIGHUP in an export (Interrupted)
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum  # as the shell reports a process the signal ended: 130, 143
