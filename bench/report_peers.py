"""``BENCHMARKS.md``'s sections that set tfgraph beside other tools: the ``peers`` optimizers,
the ``exporters`` (cached decode and prefill, tfgraph's zoo) and the ``precision`` variants."""

from __future__ import annotations

from tfgraph.bench.report_cells import ms
from tfgraph.exporters.ort.ops import MATMUL_NBITS, SIMPLIFIED_LAYER_NORM


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
        f"are `{SIMPLIFIED_LAYER_NORM}` after a `ReduceMean` + `Sub` they leave in place, "
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
            + " | ".join(ms(peer["seconds"][s]) if s in peer["seconds"] else "–" for s in seqs)
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
    """The summary against the best peer, tfgraph's zoo against the past (full runs), and
    one table per model with every exporter."""
    pasts = [str(p) for p in d["pasts"]]
    lines = _exporters_summary(d, pasts)
    if d.get("zoo"):
        lines += _zoo_table(d, pasts)
    return lines + _exporter_tables(d, pasts)


def _exporters_summary(d: dict, pasts: list[str]) -> list[str]:
    """The method paragraph, then tfgraph against the best peer per model."""
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
            f"| {name} | {ms(ours['step_seconds']['512'])} | {ms(best['step_seconds']['512'])} "
            f"({PEER_LABELS[row['best_peer_step']]}) | {row['step_512_vs_best']:.2f}× "
            f"| {ms(ours['prefill_seconds'])} | {ms(bestp['prefill_seconds'])} "
            f"({PEER_LABELS[row['best_peer_prefill']]}) | {row['prefill_vs_best']:.2f}× "
            f"| {ours.get('step_1016_over_128', float('nan')):.2f} |"
        )
    lines.append("")
    return lines


def _zoo_table(d: dict, pasts: list[str]) -> list[str]:
    """tfgraph's zoo decoders: the step at each past, and the attention kernels alone."""
    lines = [
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
        steps = " | ".join(ms(e["step_seconds"][p]) for p in pasts)
        kernels = e.get("kernel_seconds")
        alone = f"{ms(kernels[pasts[0]])} / {ms(kernels[pasts[-1]])}" if kernels else "—"
        floor = f"{e['kernel_floor']:.2f}" if "kernel_floor" in e else "—"
        lines.append(
            f"| {preset} | {e['nodes']} | {steps} | {e['step_1016_over_128']:.2f} "
            f"| {alone} | {floor} |"
        )
    lines.append("")
    return lines


def _exporter_tables(d: dict, pasts: list[str]) -> list[str]:
    """One table per model: every exporter's nodes, prefill and steps, or why it has none."""
    lines: list[str] = []
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
            steps = [ms(e["step_seconds"][p]) if p in e["step_seconds"] else "—" for p in pasts]
            prefill = ms(e["prefill_seconds"]) if "prefill_seconds" in e else "—"
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
        f"in every variant (`--weights int8|int4`: {MATMUL_NBITS}, block 32, asymmetric, LM head "
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
                f"| {ms(e['prefill_seconds'])} | {e['weight_bytes'] / 2**20:.1f} "
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
