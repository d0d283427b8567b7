"""``BENCHMARKS.md``'s ``scale`` section: export time, peak memory and decode step against
model size, and the int4 artifacts' parity and greedy generation."""

from __future__ import annotations

SCALE_PEERS = ("tfgraph fp32", "tfgraph fp32 (no cache)", "tfgraph int4", "builder fp32",
               "builder int4")  # fmt: skip


def scale_section(d: dict) -> list[str]:
    lines = [
        "## Scale: export time, peak memory and decode step against model size",
        "",
        "`python -m tfgraph bench --only scale` — random-init checkpoints of published shapes "
        "(written tensor by tensor), each exported in its own process: tfgraph `export DIR "
        "--kv-cache` (fp32) and `… --weights int4` (parity, cache parity and the quantization "
        "report included), the onnxruntime-genai builder `-p fp32` / `-p int4 -e cpu` (no "
        f"parity). Peak RSS of the whole process tree, sampled every 0.2 s; runs above "
        f"{d['cap_gib']:g} GiB are killed. Decode step: batch 1, past {d['past']}, "
        f"{d['threads']} threads, median of 5 in a fresh process; session RSS after loading.",
        "",
        "| model | checkpoint | exporter | export wall | parity | peak RSS | artifact | "
        "decode step | session RSS |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in d["models"].items():
        size = f"{m['parameters'] / 1e9:.2f}B, {m['dtype']}, {m['checkpoint_gib']:.1f} GiB"
        for peer in SCALE_PEERS:
            r = m.get(peer)
            if r is None:
                continue
            if "killed" in r:
                status = f"{r['killed']} after {r['wall_s']:.0f} s"
                lines.append(f"| {name} | {size} | {peer} | {status} | — | — | — | — | — |")
                continue
            if r.get("exit"):
                lines.append(
                    f"| {name} | {size} | {peer} | refused/failed after {r['wall_s']:.0f} s: "
                    f"{r.get('error', '?')} | — | {r['peak_rss_gib']:.2f} GiB | — | — | — |"
                )
                continue
            decode = f"{r['decode_step_ms']:.1f} ms" if "decode_step_ms" in r else "—"
            session = f"{r['session_rss_gib']:.2f} GiB" if "session_rss_gib" in r else "—"
            checked = (r.get("report") or {}).get("passed")
            parity = "—" if checked is None else ("pass" if checked else "FAIL")
            lines.append(
                f"| {name} | {size} | {peer} | {r['wall_s']:.0f} s | {parity} | "
                f"{r['peak_rss_gib']:.2f} GiB | {r.get('artifact_gib', 0):.2f} GiB | {decode} | "
                f"{session} |"
            )
    lines.append("")
    for name, m in d["models"].items():
        r = m.get("tfgraph int4") or {}
        g = r.get("generation")
        report = r.get("report") or {}
        if report:
            timings = ", ".join(f"{k} {v:.0f} s" for k, v in (report.get("timings") or {}).items())
            lines.append(
                f"- {name} int4: parity {'pass' if report.get('passed') else 'FAIL'} (max abs "
                f"err {report.get('max_abs_err', 0):.3g}); stages: {timings}."
            )
        if g and "tokens_equal" in g:
            parted = g.get("first_difference")
            said = "equal" if g["tokens_equal"] else f"part at token {parted}"
            forced = g.get("forced")
            if forced:
                said += (
                    f"; judged on the engine's own prefix (one eager pass): {forced['equal']} "
                    f"equal, {forced['near_ties']} near ties (eager's margin ≤ "
                    f"{forced['max_tie_margin']:.3g}; the two sides' logits at most "
                    f"{forced['max_logits_diff']:.3g} apart, bound {forced['bound']:.3g}), "
                    f"{forced['unexplained']} unexplained"
                )
            lines.append(
                f"- {name} int4: `generate` vs the streamed eager with the artifact's dequantized "
                f"weights, {g['new_tokens']} greedy tokens: {said} ({g['seconds']:.0f} s, peak "
                f"{g['peak_rss_gib']:.2f} GiB)."
            )
    measured = {m["measured"] for m in d["models"].values() if m.get("measured")}
    if len(measured) > 1:  # rows merged from runs at different commits: each one's named
        lines.append("")
        for name, m in d["models"].items():
            lines.append(f"- {name} measured {m.get('measured', 'in an earlier run')}.")
    return [*lines, "", "![scale](bench/scale.png)", ""]
