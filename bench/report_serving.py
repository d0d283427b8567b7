"""``BENCHMARKS.md``'s ``serving`` section: the Triton generation model under load."""

from __future__ import annotations


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
    return lines + _shared_prefix(d.get("shared_prefix"))


def _shared_prefix(p: dict | None) -> list[str]:
    """The shared-prefix run: TTFT with and without prefix caching."""
    if not p:
        return []
    m = p["model"]
    lines = [
        f"### {p['clients']} clients sharing a {p['prefix']}-token prefix (random Llama-shaped, "
        f"{m['d_model']} wide, {m['n_layers']} layers, {m['max_seq_len']} positions; each its "
        f"own 8–64-token tail and {p['new_tokens']} new tokens; prefill in chunks of "
        f"{p['prefill_chunk']}; medians of {len(p['rounds']['prefix_cache'])} rounds)",
        "",
        "| prefix cache | TTFT p50 | TTFT p99 | tokens/s |",
        "|---|---|---|---|",
    ]
    for mode in ("no_prefix_cache", "prefix_cache"):
        r = p[mode]
        lines.append(f"| {mode} | {r['ttft_ms_p50']:.0f} ms | {r['ttft_ms_p99']:.0f} ms | "
                     f"{r['tokens_per_s']:.0f} |")  # fmt: skip
    return [*lines, "", f"TTFT p50 with / without: {p['ttft_p50_ratio']:.2f}×.", ""]
