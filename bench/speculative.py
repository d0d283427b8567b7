"""Speculative decoding at batch 1 on the trained reference model (issue 49): plain decoding
against a draft model (the smaller ``bench/reference_draft``, same tokenizer) at k = 2, 4, 6 and
adaptive, and prompt lookup, on held-out text prompts and on a copy task; beside llama.cpp's
``llama-speculative`` / ``llama-lookup`` and onnxruntime-genai's n-gram speculative options on
the same checkpoints.

    python -m tfgraph.bench.speculative [--quick] [--out docs/bench/speculative.json]
        [--rounds 3] [--llama-cpp DIR] [--work speculative-work]

Each mode runs in a fresh child process that never imports torch (ONNX Runtime, 2 threads),
the modes interleaved in rounds (the order rotated each round); a mode's figure is the median
over rounds of its decode tokens/s — the tokens after the first over the time after the
prefill's token — and its speedup the median of its ratio to plain decoding in the same round.
Greedy tokens of every tfgraph mode must equal plain decoding's (asserted). Prompts:
``heldout``, 128-token windows of the model's held-out text; ``copy``, a 64-token held-out
snippet twice and then its first 8 tokens, so the continuation can repeat the snippet (the
19 M reference model copies weakly: one occurrence and a 16-token head gave it less to match).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
MODEL, DRAFT = HERE / "reference_model", HERE / "reference_draft"
THREADS = 2
MAX_NEW = 64
PROMPT_TOKENS, SNIPPET, COPY_HEAD = 128, 64, 8
PRECISIONS = {"fp32": {}, "int4": {"weights": "int4", "block_size": 32}}


def modes(quick: bool) -> list[dict]:
    """The tfgraph modes: plain, the draft at each k and adaptive, prompt lookup."""
    out = [{"name": "plain"}]
    for k in (2, 4) if quick else (2, 4, 6):
        out.append({"name": f"draft k={k}", "draft": True, "k": k})
    out.append({"name": "draft adaptive", "draft": True, "k": 4, "adaptive": True})
    out.append({"name": "draft k=6 p>=0.5", "draft": True, "k": 6, "min_p": 0.5})
    out.append({"name": "lookup k=4", "lookup": 3, "k": 4})
    if not quick:
        out.append({"name": "lookup adaptive", "lookup": 3, "k": 4, "adaptive": True})
    return out


def prompts(model_dir: Path, count: int) -> dict[str, list[list[int]]]:
    """``count`` held-out prompts and ``count`` copy-task prompts (module doc), token ids."""
    import transformers

    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(model_dir)
    text = (model_dir / "heldout.txt").read_text(encoding="utf-8")
    ids = tokenizer(text)["input_ids"]
    stride = (len(ids) - PROMPT_TOKENS) // (2 * count)
    heldout = [ids[i * stride : i * stride + PROMPT_TOKENS] for i in range(count)]
    copy = []
    for i in range(count):
        start = (count + i) * stride
        snippet = ids[start : start + SNIPPET]
        copy.append(snippet + snippet + snippet[:COPY_HEAD])
    return {"heldout": heldout, "copy": copy}


def export(model_dir: Path, out: Path, fields: dict) -> Path:
    """A KV-cached tfgraph export of ``model_dir`` (reused when ``out`` has one)."""
    import tfgraph

    if not (out / "report.json").is_file():
        tfgraph.export(str(model_dir), out, kv_cache=True, **fields)
    if not json.loads((out / "report.json").read_text())["parity"]["passed"]:
        raise RuntimeError(f"the export {out} failed parity")
    return out


# ------------------------------------------------------------------ the child process
def child(spec: dict) -> dict:
    """One mode over every prompt: the tokens, decode seconds, and the speculative counters."""
    from tfgraph.runtime import CachedDecoder, GenerationConfig, open_runner, stream
    from tfgraph.runtime.drafters import DraftModel, PromptLookup
    from tfgraph.runtime.speculative import DraftLength, SpeculativeStats
    from tfgraph.runtime.speculative_loop import speculative_stream

    # a target and its draft take turns: neither session spin-waits (Session's spinning)
    spinning = not spec.get("draft")
    target = CachedDecoder(open_runner(spec["target"], threads=THREADS, spinning=spinning))
    draft = None
    if spec.get("draft"):
        draft = CachedDecoder(open_runner(spec["draft_path"], threads=THREADS, spinning=False))
    config = GenerationConfig(max_new_tokens=MAX_NEW)
    stats = SpeculativeStats()

    def rounds(prompt):
        if draft is None and not spec.get("lookup"):
            return ([t for t in step.tokens.values()] for step in stream(target, [prompt], config))
        if draft is not None:
            drafter = DraftModel(draft, target, min_probability=spec.get("min_p", 0.0))
        else:
            drafter = PromptLookup(spec["lookup"])
        length = DraftLength(k=spec["k"], adaptive=spec.get("adaptive", False))
        return speculative_stream(target, prompt, drafter, config, length=length, stats=stats)

    for _ in rounds(spec["prompts"][0]):  # warm-up: sessions' first runs
        pass
    stats = SpeculativeStats()
    tokens, seconds = [], []
    for prompt in spec["prompts"]:
        out, first = [], None
        for emitted in rounds(prompt):
            out.extend(emitted)
            if first is None:
                first = time.perf_counter()
        seconds.append(time.perf_counter() - first)
        tokens.append(out)
    counters = {"acceptance": stats.acceptance, "tokens_per_step": stats.tokens_per_step}
    return {"tokens": tokens, "seconds": seconds, **counters}


def run_child(spec: dict) -> dict:
    cmd = [sys.executable, "-m", "tfgraph.bench.speculative", "--child", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{spec['name']} failed: {(done.stderr or done.stdout)[-400:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def tokens_per_second(result: dict) -> float:
    """Decode tokens/s: the tokens after each prompt's first over the time after it."""
    count = sum(len(t) - 1 for t in result["tokens"])
    return count / sum(result["seconds"])


# ------------------------------------------------------------------ the bench
def bench_tfgraph(paths: dict, task_prompts: dict, quick: bool, rounds: int, progress) -> list:
    """Rows of (precision, task, mode): medians over interleaved rounds of fresh processes."""
    rows = []
    for precision, (target, draft) in paths.items():
        for task, ids in task_prompts.items():
            table = {m["name"]: {**m, "runs": []} for m in modes(quick)}
            names = list(table)
            for r in range(rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    spec = {**table[name], "target": str(target), "draft_path": str(draft)}
                    spec = {k: v for k, v in spec.items() if k != "runs"} | {"prompts": ids}
                    table[name]["runs"].append(run_child(spec))
                    rate = tokens_per_second(table[name]["runs"][-1])
                    progress(f"{precision} {task} {name} round {r + 1}: {rate:.1f} tokens/s")
            rows += summarize(table, precision, task)
    return rows


def summarize(table: dict, precision: str, task: str) -> list[dict]:
    plain = table["plain"]["runs"]
    rows = []
    for name, entry in table.items():
        runs = entry["runs"]
        equal = all(run["tokens"] == plain[0]["tokens"] for run in runs)
        assert equal, f"{precision} {task} {name}: greedy tokens differ from plain decoding"
        ratios = [
            tokens_per_second(a) / tokens_per_second(b) for a, b in zip(runs, plain, strict=True)
        ]
        draftless = name == "plain"
        accepted = [r["acceptance"] for r in runs]
        per_step = [r["tokens_per_step"] for r in runs]
        rows.append(
            {
                "engine": "tfgraph",
                "precision": precision,
                "task": task,
                "mode": name,
                "tokens_per_s": statistics.median(tokens_per_second(r) for r in runs),
                "speedup": statistics.median(ratios),
                "acceptance": None if draftless else statistics.median(accepted),
                "tokens_per_step": 1.0 if draftless else statistics.median(per_step),
                "tokens_equal": equal,
                "rounds": len(runs),
            }
        )
    return rows


def bench(
    work: Path,
    quick: bool,
    rounds: int,
    llama: Path | None,
    progress,
    draft_dir: Path = DRAFT,
    count: int = 3,
) -> dict:
    """Export target and draft (fp32, and int4 in a full run), time every mode, then the
    peers (one round, the first prompt of each task: llama.cpp's runs are whole processes)."""
    task_prompts = prompts(MODEL, 2 if quick else count)
    paths = {}
    for precision in ("fp32",) if quick else PRECISIONS:
        fields = PRECISIONS[precision]
        target = export(MODEL, work / f"target-{precision}", fields)
        paths[precision] = (target, export(draft_dir, work / f"draft-{precision}", fields))
        progress(f"exported {precision} target and draft")
    rows = bench_tfgraph(paths, task_prompts, quick, rounds, progress)
    result = {
        "rows": rows,
        "max_new_tokens": MAX_NEW,
        "threads": THREADS,
        "rounds": rounds,
        "prompts_per_task": len(task_prompts["copy"]),
        "draft": str(draft_dir),
    }
    if llama is not None:
        from tfgraph.bench import speculative_peers

        first = {task: ids[:1] for task, ids in task_prompts.items()}
        models = (MODEL, draft_dir)
        peers = speculative_peers.bench_llama(llama, work, first, 1, progress, models, MAX_NEW)
        result["peers"] = peers
    if not quick:
        from tfgraph.bench import speculative_peers

        peers = speculative_peers.bench_genai(work, task_prompts, rounds, progress, MODEL, MAX_NEW)
        result["peers"] = result.get("peers", []) + peers
    return result


def markdown(result: dict) -> str:
    """The table: one line per (engine, precision, task, mode)."""
    head = "| engine | precision | task | mode | decode tok/s | × plain | accepted | tok/step |"
    lines = [head, "|---|---|---|---|---:|---:|---:|---:|"]
    for r in result["rows"] + result.get("peers", []):
        cells = [
            format(r[key], fmt) if r.get(key) is not None else "—"
            for key, fmt in (
                ("tokens_per_s", ".1f"), ("speedup", ".2f"),
                ("acceptance", ".0%"), ("tokens_per_step", ".2f"),
            )
        ]  # fmt: skip
        lines.append(f"| {r['engine']} | {r['precision']} | {r['task']} | {r['mode']} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    """Speedup over plain decoding per mode, a bar per (engine, precision, task)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] + result.get("peers", []) if r.get("speedup")]
    groups = sorted({(r["engine"], r["precision"], r["task"]) for r in rows})
    names = list(dict.fromkeys(r["mode"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / max(len(groups), 1)
    for g, group in enumerate(groups):
        values = {
            r["mode"]: r["speedup"]
            for r in rows
            if (r["engine"], r["precision"], r["task"]) == group
        }
        xs = [i + g * width for i, n in enumerate(names) if n in values]
        ax.bar(xs, [values[n] for n in names if n in values], width, label=" ".join(group))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.5, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=20)
    ax.set_ylabel("decode tokens/s ÷ plain (median of rounds)")
    ax.set_title("Speculative decoding at batch 1: reference model (19 M), 2 threads")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run(quick: bool, workdir: Path, progress=lambda step: None) -> dict:
    """The suite's entry: the bench in ``workdir`` (llama.cpp from ``$TFGRAPH_LLAMA_CPP``)."""
    from tfgraph.bench.quality_peers import llama_cpp_dir

    rounds = 1 if quick else 3
    return bench(Path(workdir) / "speculative", quick, rounds, llama_cpp_dir(None), progress)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fp32 only, fewer modes, 1 round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp (default $TFGRAPH_LLAMA_CPP)")
    parser.add_argument("--work", type=Path, default=Path("speculative-work"))
    parser.add_argument("--out", type=Path, default=Path("docs/bench/speculative.json"))
    parser.add_argument("--draft", type=Path, default=DRAFT, help="the draft's HF directory")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per task")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from tfgraph.bench.quality_peers import llama_cpp_dir

    rounds = 1 if args.quick else args.rounds
    result = {"command": "python -m tfgraph.bench.speculative " + " ".join(argv or sys.argv[1:])}
    llama = llama_cpp_dir(args.llama_cpp)
    result |= bench(args.work, args.quick, rounds, llama, logger.info, args.draft, args.prompts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
