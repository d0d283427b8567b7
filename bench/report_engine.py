"""``BENCHMARKS.md``'s sections on tfgraph's own graphs: prefill against sequence length,
attention fusion, cached decode, compile cost against layer count, norm folding."""

from __future__ import annotations

from tfgraph.bench.report_cells import ms
from tfgraph.exporters.ort.ops import GROUP_QUERY_ATTENTION, MS_DOMAIN


def _extra(probe: dict) -> float:
    if "run_extra_rss_mib" in probe:  # ort_probe's key
        return probe["run_extra_rss_mib"]
    return probe["run_peak_rss_mib"] - probe["rss_before_run_mib"]  # runs before ort_probe


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
        "`all` is what a user gets (with ORT's SkipLayerNormFusion off for every engine "
        "alike; tfgraph's own `ort` graphs do not let it fire either way).",
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
                    f"| {ms(before)} | {ms(after)} | {r:.2f}× |"
                )
        lines.append("")
    return lines


def attention_section(d: dict) -> list[str]:
    lines = [
        "## Attention fusion: causal decoder prefill, fused vs unfused",
        "",
        f"`python bench/attention_prefill.py` — preset `{d['preset']}` (GQA 8:2, head size 8, "
        f"RoPE, 2 layers), ONNX Runtime CPU, {d['threads']} threads, a fresh process per row "
        "without torch. Unfused: the `cleanup` pipeline (MatMul, Softmax over n × n scores, "
        f"{d['cleanup_attention']['fused']}/{d['cleanup_attention']['total']} fused); fused: "
        f"`default` for `ort` ({d['default_attention']['fused']}/"
        f"{d['default_attention']['total']}, `{MS_DOMAIN}.{GROUP_QUERY_ATTENTION}`). Latency: "
        "median of 5 (512), 3 (4096), 1 (8192) after one warm-up; memory: peak RSS of the "
        "process, and the run's extra RSS (the runs' peak RSS, reset once the session and "
        "inputs exist, minus the RSS at that moment: what the graph itself needs).",
        "",
        "| seq | unfused | fused | unfused / fused latency | unfused peak RSS (run extra) "
        "| fused peak RSS (run extra) | fused / unfused peak | fused / unfused run extra |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for seq in d.get("seqs", (512, 4096, 8192)):
        u, f, r = d[f"cleanup/{seq}"], d[f"default/{seq}"], d[f"ratio/{seq}"]
        lines.append(
            f"| {seq} | {ms(u['seconds'])} | {ms(f['seconds'])} "
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
        f"{d['threads']} threads; tokens/s over the whole call (prefill included), median of "
        f"{d.get('repeats', 3)} after a warm-up; the tfgraph engine (`export --kv-cache`, "
        "`ort` target) in a process "
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
            f"| {size} | {ms(r['step_seconds']['past_128'])} "
            f"| {ms(r['step_seconds']['past_1016'])} | {r['step_past_1016_over_128']:.2f}× "
            f"| {r['weight_bytes'] / 1e6:.1f} MB | {r['copy_bandwidth_gb_s']:.1f} GB/s "
            f"| {ms(r['bandwidth_bound_step_seconds'])} | {r['step_past_128_over_bound']:.2f}× |"
        )
    lines.append("")
    return lines


def _cell(row: dict) -> str:
    if "skipped" in row:
        return "skipped"
    return f"{ms(row['seconds'])} / {row['peak_rss_mib']:.0f} MiB"


def prefill_section(d: dict) -> list[str]:
    lines = [
        "## Prefill: latency and peak memory against sequence length",
        "",
        "One forward pass on (1, seq) tokens. `eager`: PyTorch; `unfused`: the ONNX export with "
        "`--pipeline none`; `ort`, `onnx`, `tensorrt`: tfgraph's `default` pipeline per "
        "target, all run in ONNX Runtime on the CPU (the `tensorrt` graph, standard ops only, "
        "runs in ONNX Runtime here: TensorRT is not installable on these machines). Each cell: "
        "median latency / peak RSS of a fresh process.",
        "",
    ]
    for label, m in d["models"].items():
        configs = list(m["configs"])
        lines += [
            f"### {label} ({m['family']}, {m['layers']} layers, d {m['d_model']})",
            "",
            "| seq | " + " | ".join(configs) + " | eager / ort latency | ort / unfused memory |",
            "|---" * (len(configs) + 3) + "|",
        ]
        for seq in map(str, d["seqs"]):
            cells = [_cell(m["configs"][c].get(seq, {"skipped": "-"})) for c in configs]
            ratio = m.get("ratios", {}).get("ort", {}).get(seq, {})
            speed = ratio.get("eager_over_config_latency")
            memory = ratio.get("config_over_unfused_peak_rss")
            lines.append(
                f"| {seq} | "
                + " | ".join(cells)
                + f" | {f'{speed:.2f}×' if speed else '–'}"
                + f" | {f'{memory:.3f}' if memory else '–'} |"
            )
        lines.append("")
    return lines


def compile_section(d: dict) -> list[str]:
    doubling = d["per_doubling"]
    lines = [
        "## Compile cost against layer count",
        "",
        f"`tfgraph.export` (trace + passes + save + parity) of `{d['preset']}` widened to n "
        f"layers (d {d['d_model']}). Linear growth is a ratio of 2.0 per doubling of layers; "
        f"overall, first to last: **{doubling['total_overall']:.2f}× per doubling**.",
        "",
        "| layers | total | trace | passes | save | parity |",
        "|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        lines.append(
            f"| {r['layers']} | {r['total_s']:.2f} s | {r['trace_s']:.2f} s "
            f"| {r['passes_s']:.2f} s | {r['save_s']:.2f} s | {r['parity_s']:.2f} s |"
        )
    pairs = [f"{a}→{b}" for a, b in zip(d["layers"], d["layers"][1:], strict=False)]
    lines += [
        "",
        "Ratio per doubling between consecutive layer counts:",
        "",
        "| step | total | trace | passes |",
        "|---|---|---|---|",
    ]
    for i, pair in enumerate(pairs):
        lines.append(
            f"| {pair} | {doubling['total'][i]:.2f} | {doubling['trace'][i]:.2f} "
            f"| {doubling['passes'][i]:.2f} |"
        )
    last = d["rows"][-1]
    top = sorted(last["per_pass"].items(), key=lambda kv: -kv[1])[:8]
    lines += [
        "",
        f"Time per pass at {last['layers']} layers (the 8 slowest):",
        "",
        "| pass | time |",
        "|---|---|",
        *[f"| {name} | {ms(t)} |" for name, t in top],
        "",
    ]
    return lines
