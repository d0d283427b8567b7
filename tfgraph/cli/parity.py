"""``tfgraph parity DIR``: re-check an artifact against its source here; on failure name
the first diverging module."""

from __future__ import annotations

import sys
from pathlib import Path

from tfgraph.cli.output import print_parity


def add_parser(sub):
    p = sub.add_parser(
        "parity",
        help="re-check an artifact against its source here; on failure name the first "
        "diverging module",
    )
    p.add_argument("path", help="artifact directory (tfgraph export's)")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a model directory's own Python code to run",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from tfgraph.verify.recheck import RESULT_FILE, recheck

    result = recheck(args.path, trust_remote_code=args.trust_remote_code)
    parity = result["parity"]
    print(
        f"re-checked {result['model']} ({result['precision']}) on {parity['runner']['runner']}, "
        f"eager on {result['eager_device']}"
    )
    print_parity(parity, cached="decode" in parity)
    if parity["passed"]:
        return 0
    found = (result.get("bisect") or {}).get("first_divergence")
    if found:
        kernels = ", ".join(f"{k['op']} {k['node']}" for k in found["kernels"]) or "no fused kernel"
        print(
            f"first diverging module: {found['module']} (max abs err {found['max_abs_err']:.3g}, "
            f"max rel err {found['max_rel_err']:.3g}); inside: {kernels}"
        )
    else:
        print("bisection: every module's output within tolerance (the divergence is after them)")
    print(f"error: parity failed; see {Path(args.path) / RESULT_FILE}", file=sys.stderr)
    return 1
