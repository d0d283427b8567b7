"""Render ``BENCHMARKS.md`` from the JSON results in ``OUT/bench/`` (no timing here).

``python -m tfgraph bench --out docs`` measures and renders; ``python bench/report.py [OUT]``
re-renders from the JSON alone (default OUT: docs/).
"""

from __future__ import annotations

import json
import sys
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
                    f"| {_ms(before)} | {_ms(after)} | {r:.2f}× |"
                )
        lines.append("")
    return lines


def _extra(probe: dict) -> float:
    if "run_extra_rss_mib" in probe:  # ort_probe's key
        return probe["run_extra_rss_mib"]
    return probe["run_peak_rss_mib"] - probe["rss_before_run_mib"]  # runs before ort_probe


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
    for seq in d.get("seqs", (512, 4096, 8192)):
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
        f"{d['threads']} threads; tokens/s over the whole call (prefill included), median of "
        f"{d.get('repeats', 3)} after a warm-up; the tfgraph engine (`export --kv-cache`, "
        "`ort` profile) in a process "
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


def _cell(row: dict) -> str:
    if "skipped" in row:
        return "skipped"
    return f"{_ms(row['seconds'])} / {row['peak_rss_mib']:.0f} MiB"


def prefill_section(d: dict) -> list[str]:
    lines = [
        "## Prefill: latency and peak memory against sequence length",
        "",
        "One forward pass on (1, seq) tokens. `eager`: PyTorch; `unfused`: the ONNX export with "
        "`--pipeline none`; `ort`, `onnx`, `tensorrt`: tfgraph's `default` pipeline per "
        "profile, all run in ONNX Runtime on the CPU (the `tensorrt` graph, standard ops only, "
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
        *[f"| {name} | {_ms(t)} |" for name, t in top],
        "",
    ]
    return lines


def _trials(d: dict) -> str:
    """How a timing was taken from fresh processes (results before ``trials`` used three)."""
    n = d.get("trials", 3)
    if n == 1:  # a quick run
        return "the median of one fresh process"
    return f"the fastest median of {TRIALS_WORDS.get(n, n)} fresh processes"


def _best_of(d: dict) -> str:
    n = d.get("trials", 3)
    return (
        "one process per measurement" if n == 1 else f"fastest median of {TRIALS_WORDS.get(n, n)}"
    )


TRIALS_WORDS = {2: "two", 3: "three", 4: "four", 5: "five"}


def _err(value) -> str:
    return "–" if value is None else f"{value:.2g}"


def peers_section(d: dict) -> list[str]:
    seqs = list(map(str, d["seqs"]))
    lines = [
        "## Peers: the same model, input and threads",
        "",
        f"`{d['model']}` exported once unfused (`--pipeline none`), then optimized by each "
        f"peer where installed; {d['threads']} threads; latency: median in a fresh process "
        "without torch (ONNX Runtime's own session optimizations on, for every engine alike). "
        "`fused attention` / `fused norms` count fused ops in the result; the peers' norms "
        "are `SimplifiedLayerNormalization` after a `ReduceMean` + `Sub` they leave in place, "
        "tfgraph's one `LayerNormalization`.",
        "",
        "| engine | fused attention | fused norms | max abs err vs eager | "
        + " | ".join(f"latency {s}" for s in seqs)
        + " | "
        + " | ".join(f"vs tfgraph {s}" for s in seqs)
        + " |",
        "|---" * (4 + 2 * len(seqs)) + "|",
    ]
    for name, peer in d["peers"].items():
        if not peer.get("available"):
            lines.append(f"| {name} | not available: {peer.get('note', '')} |")
            continue
        ratios = d.get("ratios", {}).get(name, {})
        lines.append(
            f"| {name} | {peer['fused_attention']} | {peer['fused_norms']} "
            f"| {_err(peer.get('max_abs_err_vs_eager'))} | "
            + " | ".join(_ms(peer["seconds"][s]) if s in peer["seconds"] else "–" for s in seqs)
            + " | "
            + " | ".join(
                f"{ratios[s]['peer_over_tfgraph_latency']:.2f}×" if s in ratios else "–"
                for s in seqs
            )
            + " |"
        )
    lines.append("")
    return lines


PEER_LABELS = {
    "tfgraph": "tfgraph",
    "tfgraph_static": "tfgraph, onnx target (static cache)",
    "transformers": "transformers' exporter",
    "genai_builder": "onnxruntime-genai builder",
    "optimum": "Optimum",
}


def exporters_section(d: dict) -> list[str]:
    pasts = [str(p) for p in d["pasts"]]
    t = d["tiny"]
    lines = [
        "## Exporters: cached decode and prefill against what users pick instead",
        "",
        f"`python -m tfgraph.bench.exporters` — random-init Hugging Face models ({t['layers']} "
        f"layer{'s' if t['layers'] != 1 else ''}, hidden {t['hidden']}, {t['heads']} heads "
        f"({t['kv_heads']} KV heads where the "
        f"architecture has GQA), vocab {t['vocab']}; T5: 2 + 2 layers), exported by each tool "
        f"that supports them. Every graph timed the same way: ONNX Runtime CPU, {d['threads']} "
        f"threads, batch 1, {_trials(d)} without torch per measurement; prefill of "
        f"{d['prefill_tokens']} tokens (T5: its encoder plus the first decoder step), and one "
        "decode step on a cache of "
        f"{', '.join(pasts)} positions (T5: cross-attention to a {d['encoder_length']}-token "
        "encoder output). Shared-buffer graphs (tfgraph, the builder) write the new row in "
        "place; transformers' and Optimum's graphs concatenate. Nodes: the decode graph as "
        "written. Optimum (optimum-onnx, which needs transformers < 4.58) runs from the "
        "environment `TFGRAPH_OPTIMUM_PYTHON` names, on the same checkpoints."
        + (f" Measured on {d['date']} at commit {d['commit']}." if d.get("commit") else "")
        + "".join(
            f" {name}: re-measured alone on {r['date']} at commit {r['commit']} ({r['why']})."
            for name, r in d.get("rerun", {}).items()
        ),
        "",
        "| model | tfgraph step at 512 | best peer step at 512 | ratio | tfgraph prefill "
        "| best peer prefill | ratio | tfgraph step 1016 / 128 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in d["models"].items():
        ours = row["peers"].get("tfgraph", {})
        if "step_512_vs_best" not in row:
            continue
        best, bestp = row["peers"][row["best_peer_step"]], row["peers"][row["best_peer_prefill"]]
        lines.append(
            f"| {name} | {_ms(ours['step_seconds']['512'])} | {_ms(best['step_seconds']['512'])} "
            f"({PEER_LABELS[row['best_peer_step']]}) | {row['step_512_vs_best']:.2f}× "
            f"| {_ms(ours['prefill_seconds'])} | {_ms(bestp['prefill_seconds'])} "
            f"({PEER_LABELS[row['best_peer_prefill']]}) | {row['prefill_vs_best']:.2f}× "
            f"| {ours.get('step_1016_over_128', float('nan')):.2f} |"
        )
    lines.append("")
    if d.get("zoo"):
        lines += [
            "### tfgraph's zoo decoders and encoder-decoders: the step against the past",
            "",
            "Our own presets (d_model 64, 2 layers, head size 8), `ort` target, same probe. "
            "Their declared `max_seq_len` is 128; the graphs of these position schemes "
            "(RoPE, ALiBi, relative biases) run longer, so the probe measures them at the "
            "same pasts (the runtime itself refuses positions beyond `max_positions`). "
            "*Kernels alone*: the graph's attention kernels timed by themselves on the inputs "
            "the graph gave them (`ort_probe` `kernels_only`); *kernel floor*: the 1016 / 128 "
            "ratio the step would have if nothing but the kernels grew — what any graph on "
            "these kernels pays.",
            "",
            "| preset | nodes | " + " | ".join(f"step at {p}" for p in pasts)
            + f" | 1016 / 128 | kernels alone at {pasts[0]} / {pasts[-1]} | kernel floor |",
            "|---|---|" + "---|" * len(pasts) + "---|---|---|",
        ]  # fmt: skip
        for preset, e in d["zoo"].items():
            if "error" in e:
                lines.append(f"| {preset} | — | " + "— | " * len(pasts) + f"— | — | {e['error']} |")
                continue
            steps = " | ".join(_ms(e["step_seconds"][p]) for p in pasts)
            kernels = e.get("kernel_seconds")
            alone = f"{_ms(kernels[pasts[0]])} / {_ms(kernels[pasts[-1]])}" if kernels else "—"
            floor = f"{e['kernel_floor']:.2f}" if "kernel_floor" in e else "—"
            lines.append(
                f"| {preset} | {e['nodes']} | {steps} | {e['step_1016_over_128']:.2f} "
                f"| {alone} | {floor} |"
            )
        lines.append("")
    for name, row in d["models"].items():
        lines += [
            f"### {name}",
            "",
            "| exporter | nodes | prefill | " + " | ".join(f"step at {p}" for p in pasts)
            + " | 1016 / 128 | note |",
            "|---|---|---|" + "---|" * len(pasts) + "---|---|",
        ]  # fmt: skip
        for peer, e in row["peers"].items():
            label = PEER_LABELS.get(peer, peer)
            if not e.get("available"):
                lines.append(f"| {label} | — | — | " + "— | " * len(pasts) + f"— | {e['note']} |")
                continue
            steps = [_ms(e["step_seconds"][p]) if p in e["step_seconds"] else "—" for p in pasts]
            prefill = _ms(e["prefill_seconds"]) if "prefill_seconds" in e else "—"
            ratio = f"{e['step_1016_over_128']:.2f}" if "step_1016_over_128" in e else "—"
            lines.append(
                f"| {label} | {e['nodes']} | {prefill} | " + " | ".join(steps)
                + f" | {ratio} | {e.get('error', '')} |"
            )  # fmt: skip
        lines.append("")
    return lines


def precision_section(d: dict) -> list[str]:
    lines = [
        "## Precision: fp32, int8, int4 and fp16 weights on the CPU",
        "",
        "`python -m tfgraph.bench.precision` — each model exported by tfgraph with the KV cache "
        "in every variant (`--weights int8|int4`: MatMulNBits, block 32, asymmetric, LM head "
        "included, accuracy level 4 — int8 activations, the CPU default —, and int4 at level 0 "
        "— fp32 activations —; `--precision fp16`), and the Llama by the onnxruntime-genai "
        "builder at int4 (`-p int4 -e cpu`). Timed like the exporters section (fresh "
        f"processes, {d['threads']} threads, {_best_of(d)}). Decode: the mean step "
        "over a 128-token prompt + 128 greedy tokens (steps at pasts "
        f"{', '.join(map(str, d['decode_pasts']))}); prefill: {d['prefill_tokens']} tokens. "
        "Bound: weight bytes ÷ the copy bandwidth "
        f"({d['copy_bandwidth_gb_s']:.1f} GB/s). Measured on {d['date']} at commit "
        f"{d.get('commit') or '?'}.",
        "",
    ]
    for name, m in d["models"].items():
        lines += [
            f"### {name}",
            "",
            "| variant | decode ms/token | tokens/s | prefill | weight MiB | bound ms/token |",
            "|---|---|---|---|---|---|",
        ]
        rows = [(v, e) for v, e in m["variants"].items()]
        if "genai_int4" in m:
            rows.append(("onnxruntime-genai builder int4", m["genai_int4"]))
        for variant, e in rows:
            if "error" in e:
                lines.append(f"| {variant} | — | — | — | — | — ({e['error']}) |")
                continue
            lines.append(
                f"| {variant} | {e['decode_step_seconds'] * 1e3:.2f} | {e['tokens_per_s']:.0f} "
                f"| {_ms(e['prefill_seconds'])} | {e['weight_bytes'] / 2**20:.1f} "
                f"| {e['bandwidth_bound_seconds'] * 1e3:.2f} |"
            )
        ratios = []
        if "int4_over_fp32_tokens_per_s" in m:
            ratios.append(f"int4 / fp32 tokens/s: {m['int4_over_fp32_tokens_per_s']:.2f}×")
        if "int4_over_genai_int4_tokens_per_s" in m:
            ratios.append(
                f"int4 / the builder's int4 tokens/s: {m['int4_over_genai_int4_tokens_per_s']:.2f}×"
            )
        lines += ["", "; ".join(ratios) + ("." if ratios else ""), ""]
    return lines


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


def serving_section(d: dict) -> list[str]:
    lines = [
        "## Serving: the Triton generation model under load",
        "",
        "`python -m tfgraph.bench.serving` — each preset exported with the KV cache (fp32, and "
        "int8 with `--kv-dtype int8`), its `tfgraph triton` repository served by the "
        "nvidia-pytriton wheel's `tritonserver` (CPU, Python backend, decoupled) in each "
        "batching mode side by side, driven by C concurrent gRPC streaming clients sending "
        "requests back to back for a fixed duration: a mixed workload (prompt lengths and "
        "`max_new_tokens` uniform in the ranges below, greedy, seeded per client). Local: "
        "`tfgraph.runtime.stream` on the same artifact in a fresh process, one request at a "
        f"time. Measured on {d['date']} at commit {d.get('commit') or '?'}.",
        "",
    ]
    for name, m in d["models"].items():
        prompts, new = m["prompts"], m["new_tokens"]
        lines += [
            f"### {name} (prompts {prompts[0]}–{prompts[1]} tokens, {new[0]}–{new[1]} new "
            f"tokens, {m['duration_s']:g} s per round)",
            "",
            "| batching | clients | tokens/s | TTFT p50 | TTFT p99 | per-token p50 | "
            "per-token p99 | requests |",
            "|---|---|---|---|---|---|---|---|",
        ]
        rows = [("local generate", {**m["local"], "concurrency": 1})]
        for mode, b in m["batching"].items():
            rows += [(mode, r) for r in b["served"]]
        for mode, r in rows:
            lines.append(
                f"| {mode} | {r['concurrency']} | {r['tokens_per_s']:.0f} | "
                f"{r['ttft_ms_p50']:.0f} ms | {r['ttft_ms_p99']:.0f} ms | "
                f"{r['token_ms_p50']:.1f} ms | {r['token_ms_p99']:.1f} ms | {r['requests']} |"
            )
        kv = m["kv_bytes_per_slot"]
        capacity = prompts[1] + new[1]
        lines += [
            "",
            "KV cache per slot of "
            + str(capacity)
            + " positions: "
            + ", ".join(
                f"{dtype} {b / 2**20:.1f} MiB ({b / capacity / 1024:.1f} KiB per token)"
                for dtype, b in kv.items()
            )
            + ".",  # fmt: skip
        ]
        steps = dict(m.get("decode_step") or {})
        past = steps.pop("past", None)
        if steps:
            lines += ["", f"| decode step at past {past} | fp32 cache | int8 cache | int8 / fp32 |",
                      "|---|---|---|---|"]  # fmt: skip
            for batch, t in steps.items():
                lines.append(
                    f"| {batch} row(s) | {t['fp32']:.2f} ms | {t['int8']:.2f} ms | "
                    f"{t['int8'] / t['fp32']:.2f}× |"
                )
        lines.append("")
    return lines


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


SECTIONS = {
    "prefill": lambda d: prefill_section(d),
    "attention_memory": lambda d: attention_section(d),
    "decode": lambda d: decode_section(d),
    "compile_cost": lambda d: compile_section(d),
    "peers": lambda d: peers_section(d),
    "exporters": lambda d: exporters_section(d),
    "precision": lambda d: precision_section(d),
    "serving": lambda d: serving_section(d),
    "scale": lambda d: scale_section(d),
    "norm_folding": lambda d: norm_section(d),
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
    "scale": "scale.json",
    "norm_folding": "norm_folding.json",
}


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
