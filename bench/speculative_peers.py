"""The speculative bench's peers (:mod:`tfgraph.bench.speculative`): llama.cpp's
``llama-speculative`` (a draft GGUF) and ``llama-lookup`` (n-gram prompt lookup) on GGUFs of
the same two checkpoints, made by the quality bench's converter
(:func:`tfgraph.bench.quality_peers.build_gguf`).

Each run is a fresh process with 2 threads, greedy (``--temp 0``), the prompt given as text (the
token ids decoded by the model's tokenizer: llama.cpp re-tokenizes it with the same vocabulary),
``max_new`` tokens; its figure is llama.cpp's own ``decoded N tokens in T seconds`` (decode
only, as the tfgraph rows) and ``accept``. No plain row: the vendored llama.cpp's
``llama-speculative`` refuses to run without ``--model-draft`` even with ``--spec-type none``
(llama-cpp-python 0.3.36), and ``llama-simple`` times the prompt with the decode. Modes are
interleaved in rounds; medians.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

THREADS = 2
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
ACCEPT = re.compile(r"accept\s+=\s+([\d.]+)%")


def _modes(target: Path, draft: Path) -> dict[str, list[str]]:
    common = ["-m", str(target), "-t", str(THREADS), "--temp", "0", "-c", "1024", "--seed", "0"]
    return {
        "draft k=4": [
            "llama-speculative", *common, "-md", str(draft), "-td", str(THREADS),
            "--spec-draft-n-max", "4",
        ],
        "lookup k=4": ["llama-lookup", *common, "--spec-draft-n-max", "4"],
    }  # fmt: skip


def run_one(root: Path, argv: list[str], prompt: str, max_new: int) -> dict:
    """One llama.cpp run: decoded tokens, seconds and acceptance (or the error)."""
    tool = root / "build" / "bin" / argv[0]
    cmd = [str(tool), *argv[1:], "-p", prompt, "-n", str(max_new)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 600 s"}
    text = done.stdout + done.stderr
    found = DECODED.search(text)
    if done.returncode or found is None:
        lines = [line for line in text.splitlines() if line.strip()]
        return {"error": (lines or ["no output"])[-1][:200]}
    accept = ACCEPT.search(text)
    return {
        "tokens": int(found.group(1)),
        "seconds": float(found.group(2)),
        "acceptance": float(accept.group(1)) / 100 if accept else None,
    }


def bench_llama(
    root: Path, work: Path, task_prompts: dict, rounds: int, progress, models: tuple, max_new: int
) -> list[dict]:
    """Rows of (precision, task, mode) for llama.cpp: f32 and Q4_0 GGUFs of both models."""
    import transformers

    from tfgraph.bench.quality_peers import build_gguf

    model_dir, draft_dir = models  # the target's and the draft's Hugging Face directories
    target = build_gguf(root, model_dir, work / "gguf-target")
    draft = build_gguf(root, draft_dir, work / "gguf-draft")
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(model_dir)
    rows = []
    for precision, kind in (("fp32", "f32"), ("int4", "Q4_0")):
        modes = _modes(target[kind], draft[kind])
        for task, prompts in task_prompts.items():
            texts = [tokenizer.decode(p) for p in prompts]
            runs = {name: [] for name in modes}
            for r in range(rounds):
                names = list(modes)[r % len(modes) :] + list(modes)[: r % len(modes)]
                for name in names:
                    results = [run_one(root, modes[name], t, max_new) for t in texts]
                    runs[name].append(results)
                    progress(f"llama.cpp {precision} {task} {name} round {r + 1}: {results[0]}")
            rows += _summarize(runs, precision, task)
    return rows


def _rate(results: list[dict]) -> float | None:
    if any("error" in r for r in results):
        return None
    return sum(r["tokens"] for r in results) / sum(r["seconds"] for r in results)


def _summarize(runs: dict, precision: str, task: str) -> list[dict]:
    rows = []
    plain = [_rate(results) for results in runs["plain"]] if "plain" in runs else None
    for name, rounds in runs.items():
        rates = [_rate(results) for results in rounds]
        errors = [r["error"] for results in rounds for r in results if "error" in r]
        ok = [x for x in rates if x is not None]
        pairs = zip(rates, plain, strict=True) if plain else ()
        ratios = [a / b for a, b in pairs if a is not None and b]
        accepts = [
            r["acceptance"] for res in rounds for r in res if r.get("acceptance") is not None
        ]
        rows.append(
            {
                "engine": "llama.cpp",
                "precision": precision,
                "task": task,
                "mode": name,
                "tokens_per_s": statistics.median(ok) if ok else None,
                "speedup": statistics.median(ratios) if ratios else None,
                "acceptance": statistics.median(accepts) if accepts else None,
                "error": errors[0] if errors else None,
                "rounds": len(rounds),
            }
        )
    return rows


# ------------------------------------------------------------------ onnxruntime-genai
def bench_genai(
    work: Path, task_prompts: dict, rounds: int, progress, model_dir: Path, max_new: int
) -> list[dict]:
    """onnxruntime-genai on its builder's int4 (RTN, block 32) of the target: plain and its
    n-gram speculative options (``ngram_size`` 3, ``max_draft_tokens`` 4), token ids fed
    directly, in fresh processes; a draft model is not tried (configured in genai_config)."""
    from tfgraph.bench.quality_peers import build_genai

    path = build_genai(model_dir, work / "genai" / "rtn-b32", "rtn", 32)
    modes = {"plain": 0, "lookup k=4": 3}
    rows = []
    for task, prompts in task_prompts.items():
        runs = {name: [] for name in modes}
        for r in range(rounds):
            names = list(modes)[r % len(modes) :] + list(modes)[: r % len(modes)]
            for name in names:
                cmd = [sys.executable, "-m", "tfgraph.bench.speculative_peers", str(path)]
                cmd += [str(modes[name]), str(max_new), json.dumps(prompts)]
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                if done.returncode:
                    result = {"error": (done.stderr or done.stdout)[-200:]}
                else:
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                runs[name].append([result])
                progress(f"onnxruntime-genai int4 {task} {name} round {r + 1}: {result}")
        for row in _summarize(runs, "int4", task):
            rows.append({**row, "engine": "onnxruntime-genai"})
    return rows


def _genai_child(path: str, ngram: int, max_new: int, prompts: list[list[int]]) -> dict:
    """Decode tokens and seconds (after each prompt's first token) over ``prompts``."""
    import time

    import onnxruntime_genai as og

    model = og.Model(path)
    tokens, seconds, accepted, proposed = 0, 0.0, 0, 0
    for i, prompt in enumerate([prompts[0], *prompts]):  # the first: a warm-up
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + max_new, do_sample=False)
        if ngram:
            params.set_speculative_options(ngram_size=ngram, max_draft_tokens=4)
        generator = og.Generator(model, params)
        generator.append_tokens(prompt)
        generator.generate_next_token()
        start = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
        if i:
            seconds += time.perf_counter() - start
            tokens += len(generator.get_sequence(0)) - len(prompt) - 1
            stats = generator.get_speculative_stats() if ngram else {}
            accepted += stats.get("draft_tokens_accepted", 0)
            proposed += stats.get("draft_tokens_proposed", 0)
    acceptance = accepted / proposed if proposed else None
    return {"tokens": tokens, "seconds": seconds, "acceptance": acceptance}


if __name__ == "__main__":
    path, ngram, max_new, prompts = sys.argv[1:5]
    print(json.dumps(_genai_child(path, int(ngram), int(max_new), json.loads(prompts))))
