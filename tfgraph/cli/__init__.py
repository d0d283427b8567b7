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
from difflib import get_close_matches

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
    quality,
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
    quality,
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
    parser.commands = sub.choices  # command name → its parser (unknown flags: _parse)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that arguments a command does not take are refused by
    that command's parser (its own usage, not the top level's), each unknown flag with the
    closest one it takes: ``--kv-cahce`` → "did you mean --kv-cache?"; then the command's
    ``resolve(args)`` (its aliases: ``export -m MODEL OUT``), whose conflicts are usage errors."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = parser.commands[args.command]
        flags = [s for action in command._actions for s in action.option_strings]
        hints = {}
        for arg in unknown:
            close = arg.startswith("-") and get_close_matches(arg.split("=")[0], flags, n=1)
            if close:
                hints[arg] = close[0]
        said = [f"{arg}: did you mean {flag}?" for arg, flag in hints.items()]
        if len(hints) == 1:
            said = [f"did you mean {next(iter(hints.values()))}?"]
        hint = f" ({'; '.join(said)})" if said else ""
        command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if getattr(args, "resolve", None) is not None:  # a command's aliases and their conflicts
        args.resolve(args)
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = _parse(parser, argv)
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
