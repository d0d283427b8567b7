"""Render ``BENCHMARKS.md`` from the JSON results in ``OUT/bench/`` (no timing here).

``python -m tfgraph bench --out docs`` measures and renders; ``python bench/report.py [OUT]``
re-renders from the JSON alone (default OUT: docs/). Each section's table lives in a module
named for it: :mod:`~tfgraph.bench.report_engine` (tfgraph's own graphs),
:mod:`~tfgraph.bench.report_peers` (beside other tools), :mod:`~tfgraph.bench.report_serving`
and :mod:`~tfgraph.bench.report_scale`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tfgraph.bench.report_engine import (
    attention_section,
    compile_section,
    decode_section,
    norm_section,
    prefill_section,
)
from tfgraph.bench.report_peers import exporters_section, peers_section, precision_section
from tfgraph.bench.report_scale import scale_section
from tfgraph.bench.report_serving import serving_section

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _header(suite: dict | None) -> list[str]:
    lines = ["# Benchmarks", ""]
    if suite is None:
        return lines + ["Rendered from the JSON results in `bench/`.", ""]
    m = suite["machine"]
    lines += [
        f"Produced by `{suite['command']}` on {suite['date']}"
        + (" (**quick mode**: tiny models, few sizes)." if suite["quick"] else "."),
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']:.0f} GiB; "
        f"{m['threads']} threads pinned for every engine (ONNX Runtime intra-op, "
        "`torch.set_num_threads`). Versions: "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
        + ". A shared machine: transient slowdowns of up to ~3× happen, so every figure "
        "below is a ratio measured within one run, and gaps under ~15% are noise. "
        "Methods: warm-up, then the median of several runs; memory as peak RSS of a fresh "
        "process per configuration.",
        "",
    ]
    cpu = any("cpu_seconds" in info for info in suite["sections"].values())
    if cpu:  # suites since CPU time was recorded: user + system, children included
        lines += ["| section | time | CPU | status |", "|---|---|---|---|"]
    else:
        lines += ["| section | time | status |", "|---|---|---|"]
    for name, info in suite["sections"].items():
        status = info.get("error") or info.get("skipped") or "ok"
        cells = [name, f"{info.get('seconds', 0):.0f} s"]
        if cpu:
            cells.append(f"{info['cpu_seconds']:.0f} s" if "cpu_seconds" in info else "–")
        lines.append("| " + " | ".join([*cells, status]) + " |")
    lines.append("")
    plots = suite.get("plots", [])
    if plots:
        lines += ["Plots: " + ", ".join(f"[{p}](bench/{p})" for p in plots) + ".", ""]
    return lines


SECTIONS = {
    "prefill": lambda d: prefill_section(d),
    "attention_memory": lambda d: attention_section(d),
    "decode": lambda d: decode_section(d),
    "compile_cost": lambda d: compile_section(d),
    "peers": lambda d: peers_section(d),
    "exporters": lambda d: exporters_section(d),
    "precision": lambda d: precision_section(d),
    "serving": lambda d: serving_section(d),
    "serving_chunked": lambda d: [
        "## Serving: chunked prefill and prefix caching",
        *serving_section(d)[1:],
    ],
    "scale": lambda d: scale_section(d),
    "norm_folding": lambda d: norm_section(d),
    "quality": lambda d: quality_section(d),
    "decode_peers": lambda d: decode_peers_section(d),
    "speculative": lambda d: speculative_section(d),
    "scale_out": lambda d: scale_out_section(d),
}


FILES = {  # section → JSON file in OUT/bench/ (the older scripts' names kept)
    "prefill": "prefill.json",
    "attention_memory": "attention_prefill.json",
    "decode": "decode.json",
    "compile_cost": "compile_cost.json",
    "peers": "peers.json",
    "exporters": "exporters.json",
    "precision": "precision.json",
    "serving": "serving.json",
    "serving_chunked": "serving_chunked.json",  # issue 49: chunked prefill, the shared prefix
    "scale": "scale.json",
    "norm_folding": "norm_folding.json",
    "quality": "quality.json",
    "decode_peers": "decode_peers.json",
    "speculative": "speculative.json",
    "scale_out": "scale_out.json",
}


def quality_section(d: dict) -> list[str]:
    """The quality bench's table (:func:`tfgraph.bench.quality.markdown`) under its title."""
    from tfgraph.bench.quality import markdown

    return ["## Quality on the trained reference model", "", markdown(d), ""]


def decode_peers_section(d: dict) -> list[str]:
    """The int4 decode step against the peers (:func:`tfgraph.bench.decode_peers.markdown`)."""
    from tfgraph.bench.decode_peers import markdown

    return ["## Decode step against the peers (1.1B int4)", "", markdown(d), ""]


def speculative_section(d: dict) -> list[str]:
    """Speculative decoding at batch 1 (:func:`tfgraph.bench.speculative.markdown`)."""
    from tfgraph.bench.speculative import markdown

    return ["## Speculative decoding (batch 1, the reference model)", "", markdown(d), ""]


def scale_out_section(d: dict) -> list[str]:
    """Replicas behind haproxy (:func:`tfgraph.bench.scale_out.markdown`)."""
    from tfgraph.bench.scale_out import markdown

    return ["## Scale-out (replicas behind haproxy)", "", markdown(d), ""]


def render(out: Path) -> Path:
    """Write ``out/BENCHMARKS.md`` from ``out/bench/*.json``; returns its path."""
    bench = out / "bench"
    suite_file = bench / "suite.json"
    suite = json.loads(suite_file.read_text()) if suite_file.is_file() else None
    lines = _header(suite)
    for name, file in FILES.items():
        path = bench / file
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        if "skipped" in data or "error" in data:
            continue
        lines += SECTIONS[name](data)
    notes = bench / "NOTES.md"
    if notes.is_file():
        lines += [notes.read_text().strip(), ""]
    target = out / "BENCHMARKS.md"
    target.write_text("\n".join(lines))
    return target


def main() -> None:
    render(Path(sys.argv[1]) if len(sys.argv) > 1 else DOCS)


if __name__ == "__main__":
    main()
