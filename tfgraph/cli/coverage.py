"""``tfgraph coverage``: export every architecture of the installed transformers, tiny,
and measure it."""

from __future__ import annotations

import sys
from pathlib import Path

from tfgraph.cli.output import table
from tfgraph.errors import TfgraphError


def add_parser(sub):
    p = sub.add_parser(
        "coverage",
        help="export every architecture of the installed transformers, tiny, and measure it "
        "(long: run outside CI)",
    )
    p.add_argument("--out", default="docs", help="directory for COVERAGE.md and coverage.json")
    p.add_argument("--only", help="comma-separated model types (e.g. gpt2,llama)")
    p.add_argument(
        "--kind",
        help="comma-separated kinds (e.g. vision-language): measure only their rows, keep the rest",
    )
    p.add_argument("--jobs", type=int, default=1, help="architectures measured at once")
    p.add_argument("--limit", type=int, default=None, help="at most this many new rows")
    p.add_argument("--fresh", action="store_true", help="redo rows already in coverage.json")
    p.add_argument("--list", action="store_true", help="list the architectures and stop")
    p.set_defaults(func=run)


def run(args) -> int:
    from tfgraph.tools import coverage

    only = [m for m in (args.only or "").split(",") if m] or None
    kinds = [k for k in (args.kind or "").split(",") if k] or None
    unknown = sorted(set(kinds or ()) - set(coverage.KINDS))
    if unknown:
        raise TfgraphError(
            f"unknown kind {', '.join(unknown)}: use one of {', '.join(coverage.KINDS)}"
        )
    if args.list:
        rows = [[m, k, c] for m, k, c in coverage.architectures(only, kinds)]
        print(table(rows, ["model type", "kind", "class"]))
        print(f"{len(rows)} architectures")
        return 0

    def progress(row: dict, done: int, total: int) -> None:
        attention = row.get("attention")
        print(
            f"[{done}/{total}] {row['model_type']:<24} {row['kind']:<15} {row['status']:<13} "
            f"attention {attention[0] if attention else '-'}/{attention[1] if attention else '-'}"
            f"  parity {row.get('parity', '-')}  tokens {row.get('tokens_equal', '-')}"
            f"  ({row.get('seconds', 0):.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    data = coverage.run(
        Path(args.out),
        only=only,
        kinds=kinds,
        jobs=args.jobs,
        limit=args.limit,
        fresh=args.fresh,
        progress=progress,
    )
    s = data["summary"]
    print(
        f"{s['architectures']} architectures: {s['traced']} traced, {s['complete']} complete; "
        f"wrote {Path(args.out) / 'COVERAGE.md'} and coverage.json"
    )
    v = data.get("summary_vision_language")
    if v:
        print(
            f"vision-language: {v['architectures']} model types, {v['eager']} ran eagerly with "
            f"an image, {v['exported']} exported whole, {v['complete']} with tokens equal"
        )
    return 0
