"""``tfgraph fuzz``: differential fuzzing, random zoo models through every target.

hypothesis (via ``tfgraph.tools.fuzz``) is imported in ``run`` only."""

from __future__ import annotations

import json
import sys

from tfgraph.cli.output import table
from tfgraph.errors import TfgraphError


def add_parser(sub):
    p = sub.add_parser("fuzz", help="differential fuzzing: random zoo models through every target")
    p.add_argument("--examples", type=int, default=20, help="examples to draw (default 20)")
    p.add_argument("--seed", type=int, default=0, help="campaign seed (same seed, same cases)")
    p.add_argument(
        "--targets",
        default="ort,onnx,tensorrt",
        help="comma-separated targets to export each example for (default: all)",
    )
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="skip the KV-cached export and greedy generation checks",
    )
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="run every example and list all failures (no shrinking); default: stop at the "
        "first failure and shrink it to a minimal config",
    )
    p.add_argument("--replay", metavar="JSON", help="check one case printed by a failure")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        from tfgraph.tools.fuzz import FuzzCase, check_case, run_fuzz
    except ImportError as exc:
        raise TfgraphError(
            f"fuzz needs its test extras ({exc.name} is missing): pip install 'tfgraph[dev]'"
        ) from exc
    from tfgraph.exporters.targets import get_target, target_names

    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    unknown = []
    for name in targets:
        try:
            get_target(name)
        except TfgraphError:
            unknown.append(name)
    if unknown or not targets:
        raise TfgraphError(f"--targets {args.targets!r}: choose from {', '.join(target_names())}")
    if args.replay is not None:
        return _fuzz_replay(args.replay, targets, not args.no_cache, FuzzCase, check_case)
    if args.examples < 1:
        raise TfgraphError(f"--examples must be at least 1, got {args.examples}")
    report = run_fuzz(
        args.examples,
        args.seed,
        targets=targets,
        cache=not args.no_cache,
        keep_going=args.keep_going,
        progress=_fuzz_progress,
    )
    _print_fuzz_summary(report)
    if report.passed:
        return 0
    for failure in report.failures:
        print(f"\n{failure}")
        for note in getattr(failure, "__notes__", []):
            print(note)
    print(
        f"error: {len(report.failures)} failure(s); rerun with --seed {report.seed} "
        f"--examples {report.requested}, or replay a case with --replay (above)",
        file=sys.stderr,
    )
    return 1


def _fuzz_replay(text: str, targets, cache: bool, case_cls, check) -> int:
    """``fuzz --replay JSON``: check one case, as a failure message prints it."""
    try:
        case = case_cls.from_dict(json.loads(text))
    except (ValueError, TypeError, KeyError) as exc:
        raise TfgraphError(f"--replay needs a case as JSON, as a failure prints: {exc}") from exc
    print(f"replay: {case.summary()}", file=sys.stderr, flush=True)
    try:
        timings = check(case, targets=targets, cache=cache)
    except AssertionError as exc:
        print(exc)
        return 1
    print(table([[k, f"{v:.2f} s"] for k, v in timings.items()], ["stage", "time"]))
    print("passed")
    return 0


def _fuzz_progress(event) -> None:
    if event.outcome is None:
        print(f"[{event.label}] {event.case.summary()}", file=sys.stderr, flush=True)
        return
    where = f" in {event.stage}" if event.stage else ""
    print(
        f"[{event.label}] {event.outcome}{where} ({event.seconds:.1f} s)",
        file=sys.stderr,
        flush=True,
    )


def _print_fuzz_summary(report) -> None:
    examples = len(report.example_seconds)
    per = sum(report.example_seconds) / max(examples, 1)
    row = [
        f"{examples}/{report.requested}",
        str(report.count("parity")),
        str(report.count("fusion")),
        str(report.count("crash")),
        str(report.shrink_runs),
        f"{report.seconds:.0f} s ({per:.1f} s/example)",
    ]
    header = ["examples", "parity failures", "incomplete fusions", "crashes", "shrink runs"]
    print(table([row], [*header, "time"]))
    if report.near_duplicates:
        print(f"{report.near_duplicates} near-duplicate cases skipped (Hypothesis mutations)")
    print(f"seed {report.seed}: {'passed' if report.passed else 'FAILED'}")
