"""``tfgraph bench``: benchmarks (prefill, decode, compile cost, peers)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tfgraph.cli.output import table
from tfgraph.errors import TfgraphError


def add_parser(sub):
    p = sub.add_parser("bench", help="benchmarks: prefill, decode, compile cost, peers")
    p.add_argument("--quick", action="store_true", help="tiny models, few sizes (minutes)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="results directory")
    p.add_argument("--only", action="append", help="run only this section (repeatable)")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        from tfgraph.bench.suite import SECTIONS, run_suite
    except ImportError as exc:
        raise TfgraphError(
            f"bench needs its extras ({exc.name} is missing): pip install 'tfgraph[bench]'"
        ) from exc
    unknown = [s for s in args.only or [] if s not in SECTIONS]
    if unknown:
        raise TfgraphError(f"unknown section {unknown}: choose from {', '.join(SECTIONS)}")
    start = time.perf_counter()

    def progress(step: str) -> None:
        print(f"[bench {time.perf_counter() - start:6.1f} s] {step}", file=sys.stderr, flush=True)

    suite = run_suite(args.quick, args.out, only=args.only, progress=progress)
    rows = [
        [name, f"{info['seconds']:.0f} s", info.get("error") or info.get("skipped") or "ok"]
        for name, info in suite["sections"].items()
    ]
    print(table(rows, ["section", "time", "status"]))
    plots = len(suite["plots"])
    print(f"wrote {args.out / 'BENCHMARKS.md'} and {args.out / 'bench'}/ (JSON, {plots} plots)")
    failed = [n for n, info in suite["sections"].items() if "error" in info]
    if failed:
        print(f"error: sections failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
