"""``scale``: export time, peak memory and the artifact's decode step against model size.

Random-init checkpoints of published shapes, written tensor by tensor
(:mod:`tfgraph.tools.random_checkpoint`): Llama ~120M, TinyLlama 1.1B, Qwen2 1.5B, and the seed
systems of the design at their published sizes — BERT-large, RoBERTa-large, BART-large,
T5-large, Flan-T5-large and -XL, GPT-2-XL, Llama-2-7B, Mistral-7B, MPT-7B and BLOOM-7B1 (its
250k-word tied vocabulary) — in the dtype the hub ships. Each is exported in its own process,
as a user would run it (:data:`MODELS` says which exporters run on which), by

- ``tfgraph``: ``python -m tfgraph export DIR -o OUT --kv-cache`` (fp32; encoders without the
  cache) and ``… --weights int4`` (the 7B decoders: at most :data:`INT4_GOAL_GIB` peak), parity,
  cache parity and the quantization report included;
- the onnxruntime-genai model builder: ``-p fp32`` and ``-p int4``, ``-e cpu`` (no parity
  check), on the architectures it builds.

Peak RSS is the whole process tree's, sampled every 0.2 s; a run above :data:`CAP_GIB` is
killed and recorded as such (the builder loads the whole model). The decode step (batch 1, past
512, 2 threads, median of 5 in a fresh process) and the session's RSS after loading come from
:func:`tfgraph.bench.ort_probe.probe`. Artifacts are deleted after measuring; checkpoints are
kept under the work directory only for the run.

    python -m tfgraph bench --only scale
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tfgraph.bench.exporter_genai import genai_graphs
from tfgraph.bench.exporter_models import save_tokenizer
from tfgraph.bench.exporter_tfgraph import tfgraph_graphs
from tfgraph.bench.ort_probe import probe

logger = logging.getLogger(__name__)

CAP_GIB = 20.0  # a run's process tree is killed above this (the machine has 24 GiB)
TIMEOUT_S = 3600
PAST = 512
THREADS = 2
GiB = 1024**3
# name → (shape, checkpoint dtype, the exporters run on it). The seed systems of the design
# at their published sizes: bf16 where the hub ships bf16/fp16, fp32 where it ships fp32.
MODELS = {
    "llama-120m": ("llama-120m", "fp32", ("tfgraph fp32", "tfgraph int4", "builder fp32",
                                          "builder int4")),
    "tinyllama-1.1b": ("tinyllama-1.1b", "fp32", ("tfgraph fp32", "tfgraph int4",
                                                  "builder fp32", "builder int4")),
    "qwen2-1.5b": ("qwen2-1.5b", "bf16", ("tfgraph fp32", "tfgraph int4", "builder fp32",
                                          "builder int4")),
    "bert-large": ("bert-large", "fp32", ("tfgraph fp32 (no cache)",)),
    "roberta-large": ("roberta-large", "fp32", ("tfgraph fp32 (no cache)",)),
    "bart-large": ("bart-large", "fp32", ("tfgraph fp32",)),
    "t5-large": ("t5-large", "fp32", ("tfgraph fp32",)),
    "flan-t5-large": ("flan-t5-large", "fp32", ("tfgraph fp32",)),
    "flan-t5-xl": ("flan-t5-xl", "bf16", ("tfgraph fp32",)),
    "gpt2-xl": ("gpt2-xl", "fp32", ("tfgraph fp32", "tfgraph int4")),
    "llama2-7b": ("llama2-7b", "bf16", ("tfgraph fp32", "tfgraph int4", "builder fp32",
                                        "builder int4")),
    "mistral-7b": ("mistral-7b", "bf16", ("tfgraph int4", "builder int4")),
    "mpt-7b": ("mpt-7b", "bf16", ("tfgraph int4",)),
    "bloom-7b1": ("bloom-7b1", "bf16", ("tfgraph int4",)),
}  # fmt: skip
QUICK_MODELS = ("llama-120m",)
INT4_GOAL_GIB = 8.0  # a 7B int4 export's peak, parity included
PEERS = {  # exporter → (tool, its arguments, with a KV cache)
    "tfgraph fp32": ("tfgraph", [], True),
    "tfgraph fp32 (no cache)": ("tfgraph", [], False),
    "tfgraph int4": ("tfgraph", ["--weights", "int4"], True),
    "builder fp32": ("builder", ["fp32"], True),
    "builder int4": ("builder", ["int4"], True),
}


def measured(cmd: list[str], cap_gib: float = CAP_GIB, timeout: float = TIMEOUT_S) -> dict:
    """Run ``cmd``; wall seconds, the process tree's peak RSS, how it ended."""
    import tempfile

    start = time.perf_counter()
    log = tempfile.TemporaryFile("w+")  # a pipe would fill and block a chatty child (tqdm)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    peak, killed = 0, None
    output: list[str] = []
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            rss = sum(p.memory_info().rss for p in tree if p.is_running())
        except psutil.Error:
            rss = 0
        peak = max(peak, rss)
        if rss > cap_gib * GiB or time.perf_counter() - start > timeout:
            killed = f"killed at {rss / GiB:.1f} GiB" if rss > cap_gib * GiB else "timed out"
            for p in [*root.children(recursive=True), root]:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            break
        time.sleep(0.2)
    proc.wait()
    log.seek(0)
    output = [line for line in log.read().replace("\r", "\n").splitlines() if line.strip()]
    log.close()
    result = {
        "wall_s": round(time.perf_counter() - start, 1),
        "peak_rss_gib": round(peak / GiB, 2),
        "exit": proc.returncode,
    }
    if killed:
        result["killed"] = f"{killed} (cap {cap_gib:g} GiB)"
    elif proc.returncode:
        result["error"] = (output or ["no output"])[-1][:300]
    result["tail"] = output[-12:]
    return result


def _command(peer: str, checkpoint: Path, out: Path, work: Path) -> list[str]:
    kind, args, cached = PEERS[peer]
    if kind == "tfgraph":
        cache = ["--kv-cache"] if cached else []
        return [sys.executable, "-m", "tfgraph", "export", str(checkpoint), "-o", str(out),
                *cache, *args]  # fmt: skip
    builder = "onnxruntime_genai.models.builder"
    return [sys.executable, "-m", builder, "-i", str(checkpoint), "-o", str(out),
            "-p", args[0], "-e", "cpu", "-c", str(work / "genai-cache")]  # fmt: skip


def _decode(peer: str, out: Path) -> dict:
    graphs = tfgraph_graphs(out, "decoder") if peer.startswith("tfgraph") else genai_graphs(out)
    path, inputs, bind = graphs["step"](PAST)
    found = probe(path, inputs, repeats=5, threads=THREADS, bind=bind)
    return {
        "decode_step_ms": round(found["seconds"] * 1000, 2),
        "session_rss_gib": round(found["rss_before_run_mib"] / 1024, 2),
    }


GENERATED = 16


def generation_check(checkpoint: Path, artifact: Path, new_tokens: int = GENERATED) -> dict:
    """``generate`` on a quantized artifact against the streamed eager model with the
    artifact's dequantized weights, greedy, ``new_tokens`` from an 8-token prompt."""
    import json

    import numpy as np

    from tfgraph.exporters.ort.weights.quantize import reference_from_artifact
    from tfgraph.runtime import CachedDecoder, open_runner
    from tfgraph.sources import load_source
    from tfgraph.verify.activation_rule import allowed_error
    from tfgraph.verify.generation_parity import compare_greedy, forced_agreement

    source = load_source(str(checkpoint))
    report = json.loads((artifact / "report.json").read_text())
    reference = reference_from_artifact(
        source, artifact / "model.onnx", report["weights"]["parameters"]
    )
    decoder = CachedDecoder(open_runner(artifact / "model.onnx"))
    prompt = source.inputs(1, 8, seed=5)["input_ids"][0].tolist()
    start = time.perf_counter()
    found = compare_greedy(reference, decoder, [prompt], new_tokens)
    # the bound: the export's parity rule, with the activation quantization's effect measured
    # on the parity inputs (level 4) and the scale of these logits
    parity = report["parity"]["outputs"][0]
    scale = max(float(np.abs(step).max()) for step in found.engine_logits)
    bound = allowed_error(parity.get("activation_quant_err", 0.0), scale)
    forced = forced_agreement(
        reference, decoder, [prompt], found.tokens, found.engine_logits, bound
    )
    return {
        "new_tokens": new_tokens,
        "tokens_equal": found.tokens == found.want_tokens,
        "first_difference": found.divergence(),
        "accuracy_level": next((n.get("accuracy_level") for n in [report["weights"]] if n), None),
        "tokens": found.tokens[0],
        "eager_tokens": found.want_tokens[0],
        "forced": forced,  # each step judged on the engine's own prefix
        "seconds": round(time.perf_counter() - start, 1),
    }


def write_checkpoint(name: str, root: Path) -> Path:
    from tfgraph.tools.random_checkpoint import shape_config, write_random_checkpoint

    shape, dtype, _ = MODELS[name]
    config = shape_config(shape)
    path = write_random_checkpoint(config, root / name, dtype=dtype)
    save_tokenizer(config.vocab_size, path)
    return path


def run(
    quick: bool,
    workdir: Path,
    progress=lambda step: None,
    only=None,
    save=None,
    reuse=None,
    exporters=None,
    generation=True,
) -> dict:
    """``only``: model names; ``save(results)`` after each model; ``reuse``: a directory whose
    ``<name>/`` checkpoints are used instead of writing them (kept); ``exporters``: only these
    of each model's exporters; ``generation=False`` skips the greedy comparison against the
    streamed eager model (16 full passes: 10+ minutes at 7B) and says so in the row."""
    names = QUICK_MODELS if quick else tuple(MODELS)
    if only:
        names = tuple(n for n in only if n in MODELS)
    results: dict = {"past": PAST, "threads": THREADS, "cap_gib": CAP_GIB, "models": {}}
    for name in names:
        kept = reuse is not None and (Path(reuse) / name / "config.json").is_file()
        if kept:
            checkpoint = Path(reuse) / name
        else:
            progress(f"scale: writing the {name} checkpoint")
            checkpoint = write_checkpoint(name, workdir / "checkpoints")
        weights = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
        row: dict = {"checkpoint_gib": round(weights / GiB, 2), "dtype": MODELS[name][1]}
        row["shape"] = MODELS[name][0]
        row["measured"] = f"{time.strftime('%Y-%m-%d %H:%M')} at {_commit()}"
        row["parameters"] = _parameters(checkpoint)
        for peer in (p for p in MODELS[name][2] if not exporters or p in exporters):
            progress(f"scale: {name}: {peer}")
            out = workdir / "artifacts" / f"{name}-{peer.replace(' ', '-')}"
            shutil.rmtree(out, ignore_errors=True)
            entry = measured(_command(peer, checkpoint, out, workdir))
            if entry["exit"] == 0 and "killed" not in entry:
                try:
                    if PEERS[peer][2]:  # a decoder's step (an encoder has none)
                        entry.update(_decode(peer, out))
                except Exception as exc:  # noqa: BLE001 - a probe failure is recorded
                    entry["decode_error"] = str(exc)[:200]
                entry["artifact_gib"] = round(_bytes(out) / GiB, 2)
                if peer.startswith("tfgraph"):
                    entry["report"] = _report_figures(out)
                if peer == "tfgraph int4" and MODELS[name][0] in _CAUSAL_SHAPES and not generation:
                    entry["generation"] = {"error": "not run: --no-generation"}
                elif peer == "tfgraph int4" and MODELS[name][0] in _CAUSAL_SHAPES:
                    progress(f"scale: {name}: generate vs streamed eager, {GENERATED} tokens")
                    check = measured([sys.executable, "-m", "tfgraph.bench.scale", "--generation",
                                      str(checkpoint), str(out)])  # fmt: skip
                    entry["generation"] = _last_json(check)
            row[peer] = entry
            shutil.rmtree(out, ignore_errors=True)
            logger.info("%s %s: %s", name, peer, {k: v for k, v in entry.items() if k != "tail"})
        results["models"][name] = row
        if save is not None:
            save(results)
        if not kept:
            shutil.rmtree(checkpoint, ignore_errors=True)
        shutil.rmtree(workdir / "genai-cache", ignore_errors=True)
    return results


# decoders whose int4 artifact ``generation_check`` compares token by token
_CAUSAL_SHAPES = {"llama-120m", "tinyllama-1.1b", "qwen2-1.5b", "llama2-7b", "mistral-7b",
                  "mpt-7b", "bloom-7b1", "gpt2-xl"}  # fmt: skip


def _commit() -> str:
    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                               text=True, check=True, cwd=Path(__file__).parent)  # fmt: skip
        return found.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "an unknown commit"


def _report_figures(out: Path) -> dict:
    import json

    report = json.loads((out / "report.json").read_text())
    parity = report["parity"]
    weights = report.get("weights") or {}
    return {
        "passed": parity["passed"],
        "max_abs_err": parity["outputs"][0]["max_abs_err"],
        "timings": report.get("timings"),
        "checkpoint_dtype": report["source"].get("checkpoint_dtype"),
        "error_vs_fp32": weights.get("error_vs_fp32"),
    }


def _last_json(result: dict) -> dict:
    import json

    for line in reversed(result.get("tail", [])):
        if line.startswith("{"):
            return {**json.loads(line), "wall_s": result["wall_s"],
                    "peak_rss_gib": result["peak_rss_gib"]}  # fmt: skip
    return {"error": (result.get("tail") or ["no output"])[-1][:300], "exit": result["exit"]}


def _parameters(checkpoint: Path) -> int:
    from tfgraph.sources.checkpoint import Checkpoint

    total = 0
    for entry in Checkpoint(checkpoint).entries.values():
        n = 1
        for d in entry.shape:
            n *= d
        total += n
    return total


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--work", default=os.environ.get("TMPDIR", "/tmp") + "/tfgraph-scale")
    parser.add_argument("--out", default="docs/bench/scale.json")
    parser.add_argument("--generation", nargs=2, metavar=("CHECKPOINT", "ARTIFACT"))
    parser.add_argument("--reuse", help="a directory of <model>/ checkpoints to use")
    parser.add_argument("--exporters", nargs="*", help=f"only these of {', '.join(PEERS)}")
    skip = "skip the 16-token greedy comparison after each int4 export"
    parser.add_argument("--no-generation", action="store_true", help=skip)
    args = parser.parse_args()
    if args.generation:
        print(json.dumps(generation_check(Path(args.generation[0]), Path(args.generation[1]))))
        return
    logging.basicConfig(level=logging.INFO)

    def save(result):
        Path(args.out).write_text(json.dumps(result, indent=2))

    result = run(
        args.quick, Path(args.work), lambda s: print(s, file=sys.stderr, flush=True), args.only,
        save=save, reuse=args.reuse, exporters=args.exporters,
        generation=not args.no_generation,
    )  # fmt: skip
    save(result)


if __name__ == "__main__":
    main()
