"""The coverage matrix's report: what makes a row complete, the summary counts, the
environment and commit a run measured, and ``COVERAGE.md``.

:mod:`tfgraph.tools.coverage` measures the rows and writes ``coverage.json`` and
``COVERAGE.md`` with these; nothing here imports it back.
"""

from __future__ import annotations

import platform
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from tfgraph.tools.coverage_generation import NEW_TOKENS

DECODER_KINDS = ("causal-lm", "seq2seq-lm", "speech-seq2seq")


def _commits_line(rows: list[dict]) -> str:
    """Which commit measured the rows: one run, or the rows per commit."""
    commits = _count(r.get("measured_at", "unknown") for r in rows)
    if len(commits) == 1:
        return f"Every row measured at commit {next(iter(commits))}."
    listed = ", ".join(
        f"{n} at {c}" for c, n in sorted(commits.items(), key=lambda x: (-x[1], x[0]))
    )
    return f"Rows measured at more than one commit: {listed}."


_CODE = ("tfgraph", "passes", "exporters", "runtime", "models", "pyproject.toml")


def source_commit() -> str:
    """The last git commit that changed tfgraph's code (documentation commits after it do not
    change what a row measures), ``+dirty`` with uncommitted changes to that code, or
    ``unknown`` outside a git checkout."""
    root = Path(__file__).resolve().parents[2]  # the checkout (above tfgraph/tools/)

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
        )
        if done.returncode:
            raise OSError(done.stderr)
        return done.stdout.strip()

    try:
        head = git("log", "-1", "--format=%h", "--", *_CODE)
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", *_CODE)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def environment() -> dict:
    import onnxruntime
    import torch
    import transformers

    import tfgraph

    return {
        "command": "python -m tfgraph coverage --out docs",
        "date": time.strftime("%Y-%m-%d"),
        "tfgraph": tfgraph.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "python": platform.python_version(),
        "commit": source_commit(),
    }


def complete(row: dict) -> bool:
    """Exported, every attention layer fused, parity, and (decoders) cached with tokens equal."""
    if row.get("status") != "exported" or not row.get("parity"):
        return False
    for family in ("attention", "recurrent"):
        fused, total = row.get(family, [0, 0])
        if fused != total:
            return False
    if row["kind"] in DECODER_KINDS:
        return bool(row.get("kv_cache") and row.get("kv_parity") and row.get("tokens_equal"))
    return True


def eligible(row: dict) -> bool:
    """Counted in the acceptance figure: built tiny and ran eagerly, and not a vision model
    without attention (a ConvNet: nothing for tfgraph to fuse or cache)."""
    status = row.get("status")
    if status in ("not built", "eager failed"):
        return False
    return not (row["kind"] == "vision" and status == "no attention")


def summarize(rows: list[dict]) -> dict:
    traced = [r for r in rows if r.get("status") == "exported"]
    return {
        "architectures": len(rows),
        "built": sum(r.get("status") != "not built" for r in rows),
        "traced": len(traced),
        "complete": sum(complete(r) for r in rows),
        "eligible": sum(eligible(r) for r in rows),
        "attention_fully_fused": sum(
            r.get("attention", [0, 0])[0] == r.get("attention", [0, 1])[1] for r in traced
        ),
        "parity": sum(bool(r.get("parity")) for r in traced),
        "decoders_traced": sum(r["kind"] in DECODER_KINDS for r in traced),
        "tokens_equal": sum(bool(r.get("tokens_equal")) for r in traced),
        "by_status": _count(r.get("status", "?") for r in rows),
    }


def _count(values: Iterable[str]) -> dict:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def markdown(data: dict) -> str:
    from tfgraph.tools import coverage_vlm

    meta, summary, every = data.get("meta", {}), data.get("summary", {}), data.get("rows", [])
    rows = [r for r in every if r["kind"] != coverage_vlm.KIND]  # whole VLMs: their section
    vlm = [r for r in every if r["kind"] == coverage_vlm.KIND]
    traced = summary.get("traced", 0)
    statuses = ", ".join(f"{k} {v}" for k, v in sorted(summary.get("by_status", {}).items()))
    lines = [
        "# Coverage: every architecture of the installed transformers, measured",
        "",
        f"`{meta.get('command', 'python -m tfgraph coverage --out docs')}`, {meta.get('date')}: "
        f"tfgraph {meta.get('tfgraph')}, transformers {meta.get('transformers')}, "
        f"torch {meta.get('torch')}, onnxruntime {meta.get('onnxruntime')}, "
        f"Python {meta.get('python')}. Tiny random-init configs (2 layers, width 64), "
        "see `tfgraph/tools/coverage.py`.",
        "",
        *(
            [
                f"**Partial run: {len(every)} of {meta['known']} rows measured so far** "
                "(the command resumes where it stopped; the counts below are of those rows).",
                "",
            ]
            if meta.get("known", len(every)) > len(every)
            else []
        ),
        _commits_line(every),
        "",
        f"- architectures tried: **{summary.get('architectures', 0)}**; built tiny from their "
        f"config: {summary.get('built', 0)}; traced and exported: **{traced}**",
        f"- complete (every attention layer fused, parity, and for decoders a KV cache whose "
        f"{NEW_TOKENS} greedy tokens equal Hugging Face `generate`, eager greedy decoding for "
        "speech encoder-decoders): "
        f"**{summary.get('complete', 0)}** of {traced} traced "
        f"({100 * summary.get('complete', 0) / max(traced, 1):.0f}%); of the "
        f"{summary.get('eligible', 0)} that build tiny and run eagerly, convolutional vision "
        f"models without attention left out: "
        f"**{100 * summary.get('complete', 0) / max(summary.get('eligible', 0), 1):.0f}%**",
        f"- attention fully fused: {summary.get('attention_fully_fused', 0)} of {traced}; parity: "
        f"{summary.get('parity', 0)} of {traced}; decoders with equal tokens: "
        f"{summary.get('tokens_equal', 0)} of {summary.get('decoders_traced', 0)}",
        f"- by status: {statuses}",
        "",
        "| model type | kind | class | status | attention | recurrent | norm | parity "
        "| KV cache | tokens = HF | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row_line(r) for r in rows]
    if vlm:
        lines += coverage_vlm.markdown(vlm, data.get("meta_kinds") or meta)
    return "\n".join(lines) + "\n"


def _row_line(r: dict) -> str:
    """One table row: the measured columns, then every reason it fell short in its notes."""
    decoder = r["kind"] in DECODER_KINDS
    notes = [
        r.get("reason"),
        *(r.get("attention_missed") or []),
        *(r.get("recurrent_missed") or []),
        r.get("kv_reason"),
        r.get("tokens_reason"),
    ]
    if r.get("attn_fallback"):
        notes.append(f"attention: {r['attn_fallback']} (sdpa did not trace)")
    if r.get("parity_without_passes") is False:
        notes.append(
            "parity fails with --pipeline none too: torch.onnx's translation (or ONNX "
            "Runtime) already differs from eager, before any tfgraph pass"
        )
    elif r.get("parity_without_passes") is True:
        notes.append("parity holds with --pipeline none: a tfgraph pass changes the numbers")
    if str(r.get("tokens_reference", "")).startswith("eager greedy ("):
        notes.append(f"tokens compared with {r['tokens_reference']}")
    return "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
        r["model_type"],
        r["kind"],
        r.get("class", ""),
        r.get("status", "?"),
        _frac(r.get("attention")),
        _frac(r.get("recurrent")) if r.get("recurrent", [0, 0])[1] else "",
        _frac(r.get("norm")),
        _yes(r.get("parity")) if r.get("status") == "exported" else "",
        _yes(r.get("kv_parity")) if decoder and "kv_cache" in r else "",
        _yes(r.get("tokens_equal")) if decoder and "tokens_equal" in r else "",
        "; ".join(str(n).replace("|", "\\|")[:200] for n in notes if n),
    )


def _frac(pair) -> str:
    return f"{pair[0]}/{pair[1]}" if pair else ""


def _yes(value) -> str:
    return "yes" if value else "no"
