"""``tfgraph quality DIR --text FILE``: the artifact's perplexity over a text beside its fp32
eager source's, ΔPPL, KL divergence and top-1 agreement (:mod:`tfgraph.verify.quality`); the
figures go into the artifact's ``report.json`` under ``quality``."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from tfgraph.cli.output import print_quality, progress


def add_parser(sub):
    p = sub.add_parser(
        "quality",
        help="perplexity, KL divergence and top-1 agreement of an artifact against its fp32 "
        "source over a text",
    )
    p.add_argument("path", help="artifact directory (tfgraph export's, with a tokenizer)")
    p.add_argument("--text", required=True, help="UTF-8 text file to measure over")
    p.add_argument(
        "--window",
        type=int,
        help="tokens per window (default: the model's context, at most 512)",
    )
    p.add_argument("--max-tokens", type=int, help="only the text's first N tokens")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from tfgraph.progress import listening
    from tfgraph.verify.quality import measure_quality

    lines = progress(2)  # the artifact, then the fp32 model: each with its windows' pace
    with listening(lines):
        figures = measure_quality(
            args.path, args.text, window=args.window, max_tokens=args.max_tokens, progress=lines
        )
    write_quality(Path(args.path), figures)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print_quality(figures)
    return 0


def write_quality(directory: Path, figures: dict) -> None:
    """``figures`` into ``directory/report.json`` under ``quality``, the file replaced
    atomically (a temporary file beside it, then renamed over it)."""
    file = directory / "report.json"
    report = json.loads(file.read_text())
    report["quality"] = figures
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(report, indent=2, default=float) + "\n")
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
