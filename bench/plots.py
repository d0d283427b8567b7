"""PNG plots of a benchmark run (matplotlib, headless): latency and memory against sequence
length, decode tokens/s and time per token against past length, compile time against layers.
Each plot is drawn only when its section's results exist; returns the file names written."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _prefill(plt, d: dict, bench: Path) -> list[str]:
    written = []
    for key, label, name in (
        ("seconds", "latency (s)", "prefill_latency.png"),
        ("peak_rss_mib", "peak RSS (MiB)", "prefill_memory.png"),
    ):
        models = list(d["models"].items())
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
        for ax, (label_m, m) in zip(axes[0], models, strict=True):
            for config, rows in m["configs"].items():
                points = [(int(s), r[key]) for s, r in rows.items() if key in r]
                if points:
                    xs, ys = zip(*sorted(points), strict=True)
                    ax.plot(xs, ys, marker="o", label=config)
            ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel=label)
            ax.set_title(label_m)
            ax.legend()
        fig.tight_layout()
        fig.savefig(bench / name, dpi=100)
        plt.close(fig)
        written.append(name)
    return written


def _decode(plt, d: dict, bench: Path) -> list[str]:
    sizes = [k for k in ("tiny", "small") if k in d]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    engines = ("tfgraph_cached", "hf_generate", "eager_no_cache")
    width = 0.8 / len(engines)
    for i, engine in enumerate(engines):
        values = [d[s]["tokens_per_s"][engine] for s in sizes]
        left.bar([j + i * width for j in range(len(sizes))], values, width, label=engine)
    left.set(yscale="log", ylabel="tokens/s", title="decode throughput (greedy, batch 1)")
    left.set_xticks([j + width for j in range(len(sizes))], sizes)
    left.legend()
    for size in sizes:
        steps = d[size].get("step_seconds_by_past") or {
            k.removeprefix("past_"): v for k, v in d[size]["step_seconds"].items()
        }
        xs = sorted(int(p) for p in steps)
        right.plot(xs, [steps[str(x)] * 1000 for x in xs], marker="o", label=size)
    right.set(xlabel="past length", ylabel="ms per token", title="cached decode step")
    right.legend()
    fig.tight_layout()
    fig.savefig(bench / "decode.png", dpi=100)
    plt.close(fig)
    return ["decode.png"]


def _compile(plt, d: dict, bench: Path) -> list[str]:
    fig, ax = plt.subplots(figsize=(6, 4))
    layers = [r["layers"] for r in d["rows"]]
    for key in ("total_s", "trace_s", "passes_s"):
        ax.plot(layers, [r[key] for r in d["rows"]], marker="o", label=key.removesuffix("_s"))
    ax.set(xscale="log", yscale="log", xlabel="layers", ylabel="seconds", title="compile cost")
    ax.legend()
    fig.tight_layout()
    fig.savefig(bench / "compile_cost.png", dpi=100)
    plt.close(fig)
    return ["compile_cost.png"]


def _serving(plt, d: dict, bench: Path, file: str = "serving.png") -> list[str]:
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(16, 4))
    styles = {"static": ":", "inflight": "-", "inflight_int8": "--", "inflight_chunked": "-.",
              "inflight_chunk32": (0, (1, 1)), "inflight_chunk16": (0, (3, 1, 1, 1))}  # fmt: skip
    for name, m in d["models"].items():
        color = None
        for mode, b in m["batching"].items():
            runs = b["served"]
            cs = [r["concurrency"] for r in runs]
            style = styles.get(mode, "-")
            (line,) = left.plot(cs, [r["tokens_per_s"] for r in runs], marker="o",
                                linestyle=style, color=color, label=f"{name} {mode}")  # fmt: skip
            color = line.get_color()
            mid.plot(cs, [r["ttft_ms_p50"] for r in runs], marker="o", linestyle=style,
                     color=color, label=f"{name} {mode}")  # fmt: skip
            right.plot(cs, [r["token_ms_p99"] for r in runs], marker="o", linestyle=style,
                       color=color, label=f"{name} {mode}")  # fmt: skip
    left.set(xscale="log", xlabel="concurrent streams", ylabel="generated tokens/s")
    left.set_title("throughput (mixed workload)")
    mid.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms")
    mid.set_title("time to first token, p50")
    right.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms")
    right.set_title("per-token latency, p99")
    for ax in (left, mid, right):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(bench / file, dpi=100)
    plt.close(fig)
    return [file]


def _scale(plt, d: dict, bench: Path) -> list[str]:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    peers = ("tfgraph fp32", "tfgraph int4", "builder fp32", "builder int4")
    for peer in peers:
        points = [
            (m["parameters"] / 1e9, m[peer])
            for m in d["models"].values()
            if peer in m and not m[peer].get("exit") and "killed" not in m[peer]
        ]
        if not points:
            continue
        xs = [x for x, _ in points]
        style = "-" if peer.startswith("tfgraph") else "--"
        axes[0].plot(xs, [r["wall_s"] for _, r in points], style, marker="o", label=peer)
        axes[1].plot(xs, [r["peak_rss_gib"] for _, r in points], style, marker="o", label=peer)
        decode = [(x, r["decode_step_ms"]) for x, r in points if "decode_step_ms" in r]
        if decode:
            axes[2].plot(*zip(*decode, strict=True), style, marker="o", label=peer)
    for ax, label in zip(
        axes, ("export wall (s)", "peak RSS (GiB)", "decode step (ms)"), strict=True
    ):
        ax.set(xscale="log", xlabel="parameters (billions)", ylabel=label)
        ax.legend()
    axes[1].axhline(d["cap_gib"], color="grey", linestyle=":")
    fig.tight_layout()
    fig.savefig(bench / "scale.png", dpi=100)
    plt.close(fig)
    return ["scale.png"]


def _scale_out_plot(plt, d: dict, bench: Path) -> list[str]:
    from tfgraph.bench.scale_out import plot

    return plot(plt, d, bench)


def draw(results: dict, bench: Path) -> list[str]:
    """``results``: section name → its result dict (sections with errors already left out)."""
    plt = _pyplot()
    written = []
    for name, fn in (
        ("prefill", _prefill),
        ("decode", _decode),
        ("compile_cost", _compile),
        ("serving", _serving),
        ("serving_chunked", lambda plt, d, bench: _serving(plt, d, bench, "serving_chunked.png")),
        ("scale", _scale),
        ("scale_out", lambda plt, d, bench: _scale_out_plot(plt, d, bench)),
    ):
        if name in results:
            written += fn(plt, results[name], bench)
    return written
