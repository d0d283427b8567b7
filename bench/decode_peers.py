"""The int4 decode step at a long past against the peers, through the loops users call
(issue 49): tfgraph, the onnxruntime-genai builder and llama.cpp on one checkpoint.

A TinyLlama-1.1B-shaped random checkpoint (:mod:`tfgraph.tools.random_checkpoint`; quick: a
two-layer Llama of width 64), exported three ways: ``python -m tfgraph export CKPT --kv-cache
--weights int4``, the builder's ``-p int4 -e cpu`` (its sessions told to use :data:`THREADS`
threads) and llama.cpp's Q4_0 (``convert_hf_to_gguf.py`` to f16, then ``llama-quantize``;
skipped without a llama.cpp build, :mod:`.quality_peers` says where it is looked for).

Each engine is timed in a fresh child process that never imports torch, :data:`THREADS`
threads, engines interleaved in rounds (the order rotates each round); a round's figure is the
median over its steps, the section's the median over rounds:

- ``tfgraph``: :func:`tfgraph.runtime.stream` on a prompt of ``past`` tokens, greedy; the wall
  time between two yields after the first (the first is the prefill's);
- ``builder``: onnxruntime-genai's ``og.Generator``: ``append_tokens(prompt)``, then the
  time of each ``generate_next_token()`` (greedy);
- ``llama.cpp Q4_0``: llama-cpp-python's ``Llama.eval`` (its generation loop's step) after
  an argmax over the last scores, as ``Llama.generate`` does;
- ``verify``: the tfgraph artifact's :meth:`CachedDecoder.step` of ``k + 1`` new tokens (the
  last token and ``k`` drafted ones: speculative decoding's verification) and of one new token
  (and of each count in :data:`NEW_TOKENS`: the cost curve) over the same past, in turn, the
  cache rolled back to the past by its length after each: the ratio of the medians.

The llama.cpp vocabulary: its converter needs a tokenizer it knows; token ids are fed
directly, so the GGUF gets a synthetic byte-level BPE of the checkpoint's vocabulary size
(:func:`gguf_source`: 256 byte symbols and merges of their pairs), never used to encode text.

    python -m tfgraph.bench.decode_peers [--quick] [--out FILE.json] [--work DIR]
        [--checkpoint DIR] [--llama-cpp DIR] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

THREADS = 2
K = 4  # drafted tokens a verification step checks (with the last one: K + 1 new tokens)
NEW_TOKENS = (1, 2, 4, 5, 8)  # the new tokens of the verify engine's steps (its cost curve)
FULL = {"shape": "tinyllama-1.1b", "past": 512, "steps": 32, "rounds": 5}
QUICK = {"shape": None, "past": 32, "steps": 6, "rounds": 1}
OUT = Path(__file__).resolve().parents[1] / "docs" / "bench" / "decode_peers.json"
ENGINES = ("tfgraph", "builder", "llama.cpp Q4_0", "verify")


# ------------------------------------------------------------------ artifacts
def write_checkpoint(shape: str | None, work: Path) -> Path:
    """A random-init checkpoint with a word-level tokenizer: ``shape`` of
    :data:`tfgraph.tools.random_checkpoint.SHAPES`, or None for the quick two-layer Llama."""
    from tfgraph.bench.exporter_models import save_tokenizer

    out = work / (shape or "tiny-llama")
    if (out / "config.json").is_file():
        return out
    if shape is None:
        import torch
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(out)
    else:
        from tfgraph.tools.random_checkpoint import shape_config, write_random_checkpoint

        config = shape_config(shape)
        write_random_checkpoint(config, out, dtype="fp32")
    save_tokenizer(config.vocab_size, out)
    return out


def _run(cmd: list[str], what: str, timeout: float = 3600) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise RuntimeError(f"{what} failed: {(lines or ['no output'])[-1][:300]}")
    return done


def export_tfgraph(checkpoint: Path, out: Path, block: int | None = None) -> Path:
    """``python -m tfgraph export CKPT --kv-cache --weights int4 -o OUT`` (parity included);
    ``block``: ``--block-size`` (default: tfgraph's, 32)."""
    if not (out / "model.onnx").is_file():
        cmd = [sys.executable, "-m", "tfgraph", "export", str(checkpoint), "--kv-cache"]
        cmd += ["--block-size", str(block)] if block else []
        _run([*cmd, "--weights", "int4", "-o", str(out)], "tfgraph export")
    return out


def export_builder(checkpoint: Path, out: Path, block: int | None = None) -> Path:
    """The builder's ``-p int4 -e cpu`` with its defaults (``block``: its
    ``block_size`` extra option, default 32; checked in the graph), sessions on
    :data:`THREADS`."""
    if not (out / "model.onnx").is_file():
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint)]
        cmd += ["-o", str(out), "-p", "int4", "-e", "cpu", "-c", str(out.parent / "cache")]
        cmd += ["--extra_options", f"block_size={block}"] if block else []
        _run(cmd, "onnxruntime-genai builder")
    if block and _block_size(out / "model.onnx") != block:  # it ignores unknown options
        raise RuntimeError(f"the builder's export in {out} is not at block size {block}")
    from tfgraph.bench.quality_peers import pin_genai_threads

    return pin_genai_threads(out, THREADS)


def _block_size(graph: Path) -> int:
    """The block size of the first block-quantized node in ``graph`` (its weights not
    loaded): the first node with both ``bits`` and ``block_size`` attributes."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    for node in model.graph.node:
        attrs = {a.name: a for a in node.attribute}
        if "bits" in attrs and "block_size" in attrs:
            return attrs["block_size"].i
    raise RuntimeError(f"no block-quantized node in {graph}")


def gguf_source(checkpoint: Path, out: Path) -> Path:
    """A directory llama.cpp's converter takes: the checkpoint's weights (linked), its config
    with a top-level ``rope_theta``, and a synthetic byte-level BPE (module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    for file in checkpoint.iterdir():
        if file.suffix == ".safetensors" or file.name.endswith(".index.json"):
            if not (out / file.name).exists():
                (out / file.name).symlink_to(file.resolve())
    config = json.loads((checkpoint / "config.json").read_text())
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 1e4))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    symbols = _byte_symbols()
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    merges = []
    for a in symbols:
        for b in symbols:
            if len(vocab) < config["vocab_size"]:
                vocab[a + b] = len(vocab)
                merges.append((a, b))
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(out)
    return out


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + n) for n in range(len(others))]


def export_gguf(checkpoint: Path, work: Path, llama: Path) -> Path:
    """llama.cpp's Q4_0 of ``checkpoint``: converted to f16, then ``llama-quantize``."""
    q4 = work / "model-Q4_0.gguf"
    if q4.is_file():
        return q4
    source = gguf_source(checkpoint, work / "hf")
    f16 = work / "model-f16.gguf"
    if not f16.is_file():
        cmd = [sys.executable, "-m", "tfgraph.bench.quality_peers", "convert", str(llama)]
        _run([*cmd, str(source), "--outtype", "f16", "--outfile", str(f16)], "convert_hf_to_gguf")
    tool = llama / "build" / "bin" / "llama-quantize"
    _run([str(tool), str(f16), str(q4), "Q4_0", str(THREADS)], "llama-quantize")
    f16.unlink()
    return q4


# ------------------------------------------------------------------ timing (child processes)
def _prompt(past: int, vocab: int) -> list[int]:
    return np.random.default_rng(0).integers(3, min(vocab, 3000), past).tolist()


def time_tfgraph(path: Path, past: int, steps: int) -> dict:
    """Seconds between the yields of :func:`tfgraph.runtime.stream` after the prefill's."""
    from tfgraph.runtime import CachedDecoder, GenerationConfig, open_runner, stream
    from tfgraph.runtime.drafters import vocab_of

    decoder = CachedDecoder(open_runner(path, threads=THREADS))
    vocab = vocab_of(decoder)
    times, last = [], None
    for _ in stream(decoder, [_prompt(past, vocab)], GenerationConfig(max_new_tokens=steps + 1)):
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    return {"times": times}


def time_verify(path: Path, past: int, steps: int, k: int = K) -> dict:
    """Steps of each count of :data:`NEW_TOKENS` new tokens (``k + 1``: the last token and
    ``k`` drafted ones, speculative decoding's verification) over the same past, in turn,
    the cache rolled back to ``past`` by its length after each (speculative decoding's use)."""
    from tfgraph.runtime import CachedDecoder, open_runner
    from tfgraph.runtime.drafters import vocab_of

    decoder = CachedDecoder(open_runner(path, threads=THREADS))
    prompt = np.asarray([_prompt(past, vocab_of(decoder))], np.int64)
    counts = sorted({*NEW_TOKENS, k + 1})
    cache = decoder.empty_cache(1, capacity=past + max(counts))
    _, cache = decoder.step(prompt, cache)
    times: dict[int, list[float]] = {new: [] for new in counts}
    for _ in range(steps):
        for new in counts:
            start = time.perf_counter()
            logits, _ = decoder.step(prompt[:, :new], cache)
            logits[0, -1].argmax()
            times[new].append(time.perf_counter() - start)
    by_new = {str(new): times[new] for new in counts}
    return {"times": times[1], "verify_times": times[k + 1], "k": k, "by_new": by_new}


def time_builder(path: Path, past: int, steps: int) -> dict:
    """``og.Generator``: the prompt appended, then each ``generate_next_token``."""
    import onnxruntime_genai as og

    model = og.Model(str(path))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=past + steps + 2, do_sample=False)
    generator = og.Generator(model, params)
    config = json.loads((path / "genai_config.json").read_text())
    generator.append_tokens(_prompt(past, config["model"]["vocab_size"]))
    generator.generate_next_token()  # the prompt's token: chosen from the prefill's logits
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        generator.generate_next_token()
        times.append(time.perf_counter() - start)
    return {"times": times}


def time_gguf(path: Path, past: int, steps: int, llama: Path) -> dict:
    """llama-cpp-python's ``eval`` of each greedy token (its ``generate`` loop's step)."""
    from tfgraph.bench.quality_peers import _binding

    binding = _binding(llama)
    model = binding.Llama(
        model_path=str(path), n_ctx=past + steps + 8, n_batch=past + steps + 8, n_threads=THREADS,
        n_threads_batch=THREADS, verbose=False,
    )  # fmt: skip
    model.eval(_prompt(past, model.n_vocab()))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        token = int(np.argmax(model.scores[model.n_tokens - 1]))
        model.eval([token])
        times.append(time.perf_counter() - start)
    return {"times": times}


def _child(engine: str, path: Path, past: int, steps: int, llama: Path | None) -> dict:
    """One fresh process's timing of ``engine``: its figures in ms."""
    cmd = [sys.executable, "-m", "tfgraph.bench.decode_peers", "time", engine, str(path)]
    cmd += ["--past", str(past), "--steps", str(steps)]
    if llama is not None:
        cmd += ["--llama-cpp", str(llama)]
    done = _run(cmd, f"{engine} timing", timeout=1800)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    figures = {"ms": round(1000 * statistics.median(result["times"]), 3)}
    if "verify_times" in result:
        figures["verify_ms"] = round(1000 * statistics.median(result["verify_times"]), 3)
        figures["ratio"] = round(figures["verify_ms"] / figures["ms"], 3)
        figures["by_new_ms"] = {
            new: round(1000 * statistics.median(times), 3)
            for new, times in result["by_new"].items()
        }
    return figures


# ------------------------------------------------------------------ the section
def artifacts(
    quick: bool, work: Path, checkpoint: Path | None, llama: Path | None, block: int | None = None
) -> dict:
    """{engine: (path, why skipped or None)} for the engines of :data:`ENGINES`; with
    ``block``, also tfgraph and the builder at that block size (``tfgraph bN``, ``builder bN``)."""
    import importlib.util

    plan = QUICK if quick else FULL
    checkpoint = checkpoint or write_checkpoint(plan["shape"], work)
    ours = export_tfgraph(checkpoint, work / "tfgraph-int4")
    found = {"tfgraph": (ours, None), "verify": (ours, None)}
    if importlib.util.find_spec("onnxruntime_genai") is None:
        found["builder"] = (None, "onnxruntime-genai is not installed")
    else:
        found["builder"] = (export_builder(checkpoint, work / "builder-int4"), None)
    if block and found["builder"][1] is None:
        ours_b = export_tfgraph(checkpoint, work / f"tfgraph-int4-b{block}", block)
        theirs_b = export_builder(checkpoint, work / f"builder-int4-b{block}", block)
        found[f"tfgraph b{block}"], found[f"builder b{block}"] = (ours_b, None), (theirs_b, None)
    if llama is None:
        found["llama.cpp Q4_0"] = (None, "no llama.cpp build (--llama-cpp DIR)")
    else:
        found["llama.cpp Q4_0"] = (export_gguf(checkpoint, work / "gguf", llama), None)
    return found


def run(
    quick: bool,
    workdir: Path,
    progress=None,
    *,
    checkpoint: Path | None = None,
    llama: Path | None = None,
    rounds: int | None = None,
    extra: dict[str, Path] | None = None,
    block: int | None = None,
) -> dict:
    """The section: engines interleaved in rounds (module docstring). ``extra``: more
    ``tfgraph`` artifacts to time beside (label → artifact; a before/after comparison)."""
    from tfgraph.bench.quality_peers import llama_cpp_dir

    plan = {**(QUICK if quick else FULL), **({"rounds": rounds} if rounds else {})}
    llama = llama_cpp_dir(llama)
    found = artifacts(quick, Path(workdir), checkpoint, llama, block)
    timed = {name: path for name, (path, why) in found.items() if why is None}
    engines = {name: name.split(" b")[0] for name in timed}  # "builder b128" runs the builder
    for label, path in (extra or {}).items():
        timed[label], engines[label] = path, "tfgraph"
    per_round: dict[str, list[dict]] = {name: [] for name in timed}
    names = list(timed)
    for r in range(plan["rounds"]):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            if progress is not None:
                progress(f"decode_peers round {r + 1}/{plan['rounds']}: {name}")
            figures = _child(engines[name], timed[name], plan["past"], plan["steps"], llama)
            per_round[name].append(figures)
    return summary(plan, found, per_round, _load())


def summary(plan: dict, found: dict, per_round: dict, load: list[float]) -> dict:
    """The medians over rounds, the ratios the issue's acceptance names, per-round figures."""
    result = {
        "threads": THREADS, "past": plan["past"], "steps": plan["steps"],
        "rounds": plan["rounds"], "shape": plan["shape"] or "tiny-llama", "k": K,
        "load_average": load,
        "skipped_engines": {name: why for name, (_, why) in found.items() if why},
        "engines": {},
    }  # fmt: skip
    for name, rounds in per_round.items():
        entry = {"ms": round(statistics.median(r["ms"] for r in rounds), 3)}
        entry["rounds_ms"] = [r["ms"] for r in rounds]
        if "verify_ms" in rounds[0]:
            entry["verify_ms"] = round(statistics.median(r["verify_ms"] for r in rounds), 3)
            entry["ratio"] = round(statistics.median(r["ratio"] for r in rounds), 3)
            entry["by_new_ms"] = {
                new: round(statistics.median(r["by_new_ms"][new] for r in rounds), 3)
                for new in rounds[0]["by_new_ms"]
            }
        result["engines"][name] = entry
    ms = {name: entry["ms"] for name, entry in result["engines"].items()}
    result["ratios"] = {
        f"tfgraph / {peer}": _round_ratio(per_round, "tfgraph", peer)
        for peer in ("builder", "llama.cpp Q4_0")
        if peer in ms and "tfgraph" in ms
    }
    for name in [n for n in ms if n.startswith("tfgraph b")]:  # the other block size
        for peer in (f"builder b{name.split(' b')[1]}", "builder", "llama.cpp Q4_0"):
            if peer in ms:
                result["ratios"][f"{name} / {peer}"] = _round_ratio(per_round, name, peer)
    if "verify" in result["engines"]:
        result["ratios"][f"verify k={K} / one-token step"] = result["engines"]["verify"]["ratio"]
    return result


def markdown(result: dict) -> str:
    """The section's table: each engine's ms/token (median over rounds), then the ratios."""
    lines = [
        f"{result['shape']}, int4, decode step at past {result['past']} ({result['steps']} steps, "
        f"{result['rounds']} interleaved rounds, {result['threads']} threads, load average "
        f"{result['load_average'][0]} at the end)",
        "",
        "| engine | ms/token | rounds |",
        "|---|---|---|",
    ]
    for name, entry in result["engines"].items():
        rounds = ", ".join(f"{ms:.1f}" for ms in entry["rounds_ms"])
        lines.append(f"| {name} | {entry['ms']:.2f} | {rounds} |")
        for new, ms in entry.get("by_new_ms", {}).items():
            lines.append(f"| {name}: a step of {new} new tokens | {ms:.2f} | |")
    lines += ["", "| ratio | median over rounds |", "|---|---|"]
    lines += [f"| {name} | {ratio:.3f} |" for name, ratio in result["ratios"].items()]
    for name, why in result.get("skipped_engines", {}).items():
        lines.append(f"\n{name}: skipped ({why})")
    return "\n".join(lines)


def _round_ratio(per_round: dict, ours: str, peer: str) -> float:
    """The median over rounds of the two engines' ratio within a round."""
    pairs = zip(per_round[ours], per_round[peer], strict=True)
    return round(statistics.median(a["ms"] / b["ms"] for a, b in pairs), 3)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _time_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="decode_peers time")
    parser.add_argument("engine", choices=["tfgraph", "verify", "builder", "llama.cpp Q4_0"])
    parser.add_argument("path", type=Path)
    parser.add_argument("--past", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--llama-cpp", type=Path)
    args = parser.parse_args(argv)
    if args.engine == "tfgraph":
        result = time_tfgraph(args.path, args.past, args.steps)
    elif args.engine == "verify":
        result = time_verify(args.path, args.past, args.steps)
    elif args.engine == "builder":
        result = time_builder(args.path, args.past, args.steps)
    else:
        result = time_gguf(args.path, args.past, args.steps, args.llama_cpp)
    print(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["time"]:
        _time_main(argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--work", type=Path, help="keep the checkpoint and artifacts here")
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--llama-cpp", type=Path)
    parser.add_argument("--rounds", type=int)
    parser.add_argument(
        "--block-size", type=int, metavar="N",
        help="also tfgraph and the builder at int4 block size N (an equal-format pair)",
    )  # fmt: skip
    parser.add_argument(
        "--also", action="append", default=[], metavar="LABEL=ARTIFACT",
        help="another tfgraph artifact to time beside (e.g. an older export)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    extra = dict(item.split("=", 1) for item in args.also)
    work = args.work
    if work is None:
        import tempfile

        work = Path(tempfile.mkdtemp(prefix="tfgraph-decode-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    result = run(
        args.quick, work, print, checkpoint=args.checkpoint, llama=args.llama_cpp,
        rounds=args.rounds, extra={k: Path(v) for k, v in extra.items()}, block=args.block_size,
    )  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, entry in result["engines"].items():
        print(f"{name:24} {entry['ms']:8.2f} ms/token  rounds {entry['rounds_ms']}")
    for name, ratio in result["ratios"].items():
        print(f"{name:40} {ratio:.3f}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
