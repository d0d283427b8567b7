"""Render docs/BENCHMARKS.md from the JSON results in docs/bench/ (no timing here).

python bench/norm_folding.py && python bench/attention_prefill.py && python bench/report.py
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:.2f} ms" if ms < 10 else f"{ms:.1f} ms"


def norm_section(d: dict) -> list[str]:
    lines = [
        "## Norm folding: prefill latency before and after",
        "",
        f"`python bench/norm_folding.py` — {d['model']}, batch {d['batch']}, ONNX Runtime CPU, "
        f"{d['threads']} threads, median of 10 after 3 warm-up runs, each configuration in a "
        "fresh process without torch, the two pipelines alternating, two rounds (the spread "
        "between rounds is the machine's noise). `cleanup` keeps the norms as traced "
        f"({d['norms']['cleanup']['fused']}/{d['norms']['cleanup']['total']} folded); "
        f"`default` folds them ({d['norms']['default']['fused']}/"
        f"{d['norms']['default']['total']}). ORT optimizations `none` isolates our pass; "
        "`all` is what a user gets (with ORT's SkipLayerNormFusion off, as tfgraph.runtime "
        "does).",
        "",
    ]
    for title, rows, ratios in (
        ("Whole model (GPT-2-small)", d["median_seconds"], d["speedup_folded_vs_unfolded"]),
        (
            "Only what folding touches: 25 LayerNorms with residual adds, d = 768",
            d["norm_stack_median_seconds"],
            d["norm_stack_speedup_folded_vs_unfolded"],
        ),
    ):
        lines += [
            f"### {title}",
            "",
            "| ORT opt | round | seq | unfolded | folded | speedup |",
            "|---|---|---|---|---|---|",
        ]
        for key, ratio in ratios.items():
            opt, rnd = key.split("/")
            for seq, r in ratio.items():
                before = rows[f"cleanup/{opt}/{rnd}"][seq]
                after = rows[f"default/{opt}/{rnd}"][seq]
                lines.append(
                    f"| {opt.removeprefix('ort-opt-')} | {rnd.removeprefix('round-')} | {seq} "
                    f"| {_ms(before)} | {_ms(after)} | {r:.2f}× |"
                )
        lines.append("")
    return lines


def _extra(probe: dict) -> float:
    return probe["run_peak_rss_mib"] - probe["rss_before_run_mib"]


def attention_section(d: dict) -> list[str]:
    lines = [
        "## Attention fusion: causal decoder prefill, fused vs unfused",
        "",
        f"`python bench/attention_prefill.py` — preset `{d['preset']}` (GQA 8:2, head size 8, "
        f"RoPE, 2 layers), ONNX Runtime CPU, {d['threads']} threads, a fresh process per row "
        "without torch. Unfused: the `cleanup` pipeline (MatMul, Softmax over n × n scores, "
        f"{d['cleanup_attention']['fused']}/{d['cleanup_attention']['total']} fused); fused: "
        f"`default` for `ort` ({d['default_attention']['fused']}/"
        f"{d['default_attention']['total']}, `com.microsoft.GroupQueryAttention`). Latency: "
        "median of 5 (512), 3 (4096), 1 (8192) after one warm-up; memory: peak RSS of the "
        "process, and the run's extra RSS (the runs' peak RSS, reset once the session and "
        "inputs exist, minus the RSS at that moment: what the graph itself needs).",
        "",
        "| seq | unfused | fused | unfused / fused latency | unfused peak RSS (run extra) "
        "| fused peak RSS (run extra) | fused / unfused peak | fused / unfused run extra |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for seq in (512, 4096, 8192):
        u, f, r = d[f"cleanup/{seq}"], d[f"default/{seq}"], d[f"ratio/{seq}"]
        lines.append(
            f"| {seq} | {_ms(u['seconds'])} | {_ms(f['seconds'])} "
            f"| {r['latency_unfused_over_fused']:.2f}× | {u['peak_rss_mib']:.0f} MiB "
            f"({_extra(u):.0f} MiB) | {f['peak_rss_mib']:.0f} MiB ({_extra(f):.0f} MiB) "
            f"| {r['peak_rss_fused_over_unfused']:.3f} "
            f"| {r['run_extra_rss_fused_over_unfused']:.4f} |"
        )
    lines.append("")
    return lines


def decode_section(d: dict) -> list[str]:
    lines = [
        "## Decode: KV-cached engine vs eager PyTorch vs Hugging Face `generate`",
        "",
        f"`python bench/decode.py` — Hugging Face `GPT2LMHeadModel` (random weights), greedy, "
        f"batch {d['batch']}, prompt {d['prompt']} + {d['new_tokens']} new tokens, "
        f"{d['threads']} threads; tokens/s over the whole call (prefill included), median of 3 "
        "after a warm-up; the tfgraph engine (`export --kv-cache`, `ort` profile) in a process "
        "without torch. Eager PyTorch recomputes the whole prefix per token; HF `generate` "
        "uses its own KV cache.",
        "",
        "| model | tfgraph cached | eager, no cache | HF `generate` | tfgraph / HF generate "
        "| tfgraph / eager | same tokens as HF |",
        "|---|---|---|---|---|---|---|",
    ]
    sizes = [k for k in ("tiny", "small") if k in d]
    for size in sizes:
        r = d[size]
        t = r["tokens_per_s"]
        name = f"{size} ({r['layers']} layers, d {r['d_model']}, vocab {r['vocab']})"
        lines.append(
            f"| {name} | {t['tfgraph_cached']:.1f} tok/s | {t['eager_no_cache']:.1f} tok/s "
            f"| {t['hf_generate']:.1f} tok/s | {r['ratio']['tfgraph_over_hf_generate']:.2f}× "
            f"| {r['ratio']['tfgraph_over_eager_no_cache']:.2f}× "
            f"| {r['same_tokens_as_hf_generate']} |"
        )
    lines += [
        "",
        "Per-token decode step of the cached engine (one token, batch 1), and the "
        "memory-bandwidth bound (weight bytes ÷ numpy copy bandwidth):",
        "",
        "| model | step at past 128 | step at past 1016 | 1016 / 128 | weights | copy bandwidth "
        "| bound | step(128) / bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size in sizes:
        r = d[size]
        lines.append(
            f"| {size} | {_ms(r['step_seconds']['past_128'])} "
            f"| {_ms(r['step_seconds']['past_1016'])} | {r['step_past_1016_over_128']:.2f}× "
            f"| {r['weight_bytes'] / 1e6:.1f} MB | {r['copy_bandwidth_gb_s']:.1f} GB/s "
            f"| {_ms(r['bandwidth_bound_step_seconds'])} | {r['step_past_128_over_bound']:.2f}× |"
        )
    lines.append("")
    return lines


def main() -> None:
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python bench/report.py` from `docs/bench/*.json`. Machine: "
        f"{platform.machine()}, 2 cores, 24 GiB (a shared machine: transient slowdowns of up "
        "to ~3× happen, so every figure below is a ratio measured within one run, and gaps "
        "under ~15% are noise).",
        "",
    ]
    bench = DOCS / "bench"
    if (bench / "norm_folding.json").is_file():
        lines += norm_section(json.loads((bench / "norm_folding.json").read_text()))
    if (bench / "attention_prefill.json").is_file():
        lines += attention_section(json.loads((bench / "attention_prefill.json").read_text()))
    if (bench / "decode.json").is_file():
        lines += decode_section(json.loads((bench / "decode.json").read_text()))
    notes = DOCS / "bench" / "NOTES.md"
    if notes.is_file():
        lines += [notes.read_text().strip(), ""]
    (DOCS / "BENCHMARKS.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
