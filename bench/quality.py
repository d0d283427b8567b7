"""What each weight format and quantization method costs on a trained model, beside the peers:
perplexity, ΔPPL, KL divergence and top-1 agreement against the fp32 eager model, artifact size
and decode step, in one run (issue 48).

The model is ``bench/reference_model`` (18.9 M parameters, trained here) and the text its
``heldout.txt``, cut as :func:`tfgraph.tools.train_reference.perplexity` cuts it: consecutive
non-overlapping windows of 256 input tokens, each predicting the token after each of its
positions. The fp32 eager logits (Hugging Face's ``LlamaForCausalLM`` in fp32) are computed once
and every row's logits go through the same
:class:`tfgraph.verify.quality_metrics.QualityTally`. Rows:

- **tfgraph** (``tfgraph.export(..., kv_cache=True)``, logits by a prefill of each window on an
  empty cache through the runtime, :class:`tfgraph.runtime.CachedDecoder`): fp32, fp16, int8
  weights, int4 with each ``weight_method`` (rtn, hqq, k_quant, gptq) at blocks 32 and 128,
  symmetric and asymmetric where the method has both, ``weights="mixed"``, an int8 KV cache.
  GPTQ and mixed calibrate on the reference model's *training* files (never the held-out text:
  :func:`calibration_text`). A row whose option this tfgraph lacks is recorded as skipped;
- **onnxruntime-genai builder** int4 (``algo_config`` rtn and k_quant, ``block_size`` 32 and
  128), run by ONNX Runtime directly with an empty past;
- **llama.cpp** (when built, :mod:`tfgraph.bench.quality_peers`): its converter's f32 and f16
  GGUF (the sanity rows: they should match fp32 eager to a few 1e-3), Q4_0 and Q4_K_M.

Every row also gets ``max_abs_logit_diff`` (the largest |logit − fp32 eager logit|), its
artifact size (the model files: ``.onnx``, external data, ``.gguf``) and its decode step in ms
at past 128, batch 1, 2 threads: the median over steps at pasts 128…143 in a fresh process per
measurement, rounds interleaved across rows, the median of the rounds.

    python -m tfgraph.bench.quality [--max-tokens N] [--llama-cpp DIR] [--work DIR]
        [--out docs/bench/quality.json] [--rounds 3]
    (or as the ``quality`` section of ``python -m tfgraph bench``)

Writes the JSON and, beside it, the markdown table (``quality.md``). ``--work DIR`` keeps the
exports and peers' builds there and reuses them on the next run (the figures are measured anew).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from tfgraph.bench import quality_peers as peers
from tfgraph.verify.quality_store import windows

logger = logging.getLogger(__name__)

MODEL = Path(__file__).parent / "reference_model"
WINDOW = 256
CALIBRATION_CHARS = 40_000  # the first training files: ~8 k tokens, none of them held out
QUICK_TOKENS = 1024
FIGURES = ("ppl", "delta_ppl", "delta_ppl_pct", "kl_mean", "kl_max", "top1")


@dataclasses.dataclass
class Row:
    """One line of the table: ``engine`` (tfgraph, genai, llama.cpp) and how it was made."""

    name: str
    engine: str
    fields: dict = dataclasses.field(default_factory=dict)  # tfgraph's ExportOptions fields
    peer: tuple = ()  # the builder's (algo, block) or llama.cpp's GGUF type
    result: dict = dataclasses.field(default_factory=dict)
    path: Path | None = None


def tfgraph_rows(calibration: Path) -> list[Row]:
    """tfgraph's formats and methods (module docstring)."""
    rows = [
        Row("fp32", "tfgraph", {}),
        Row("fp16", "tfgraph", {"precision": "fp16"}),
        Row("int8 weights b32", "tfgraph", {"weights": "int8", "block_size": 32}),
    ]
    for block in (32, 128):
        for method, symmetric in (
            ("rtn", True), ("rtn", False), ("hqq", False),
            ("k_quant", False), ("gptq", True), ("gptq", False),
        ):  # fmt: skip
            fields = {"weights": "int4", "block_size": block, "symmetric": symmetric}
            if method != "rtn":
                fields["weight_method"] = method
            if method == "gptq":
                fields["calibration_text"] = str(calibration)
            kind = "sym" if symmetric else "asym"
            rows.append(Row(f"int4 {method} b{block} {kind}", "tfgraph", fields))
    mixed = {"weights": "mixed", "block_size": 32, "calibration_text": str(calibration)}
    rows.append(Row("mixed int4/int8 b32", "tfgraph", mixed))
    rows.append(Row("fp32 + int8 KV cache", "tfgraph", {"kv_dtype": "int8"}))
    return rows


def peer_rows(llama: Path | None) -> list[Row]:
    """The builder's int4 and llama.cpp's GGUF rows."""
    rows = [
        Row(f"builder int4 {algo} b{block}", "genai", peer=(algo, block))
        for algo in ("rtn", "k_quant")
        for block in (32, 128)
    ]
    if llama is not None:
        rows += [Row(f"llama.cpp {kind}", "llama.cpp", peer=(kind,)) for kind in ("f32", "f16")]
        rows += [Row(f"llama.cpp {kind}", "llama.cpp", peer=(kind,)) for kind in peers.GGUF_TYPES]
    return rows


def quick_rows(rows: list[Row]) -> list[Row]:
    """A quick run's rows: fp32, int8, int4 rtn at block 32 and one peer of each kind."""
    keep = {"fp32", "int8 weights b32", "int4 rtn b32 sym", "builder int4 rtn b32"}
    keep |= {"llama.cpp Q4_0"}
    return [row for row in rows if row.name in keep]


# ------------------------------------------------------------------ text and reference
def text_ids(model_dir: Path, text: Path, max_tokens: int | None) -> np.ndarray:
    """The text's token ids by the model's own tokenizer (no special tokens: as trained)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = np.array(tokenizer.encode(text.read_text(encoding="utf-8")).ids, np.int64)
    return ids[:max_tokens] if max_tokens else ids


def calibration_text(out: Path) -> Path:
    """The first training files of the reference model's corpus (none held out) in ``out``."""
    from tfgraph.tools.train_reference import corpus_files, read_text

    if not out.is_file():
        train, _held = corpus_files()
        out.write_text(read_text(train, CALIBRATION_CHARS), encoding="utf-8")
    return out


def reference_logits(model_dir: Path, ids: np.ndarray, spans) -> list[np.ndarray]:
    """The fp32 eager model's logits of every window, computed once."""
    import torch
    import transformers

    torch.set_num_threads(1)  # the shared 2-core machine: the reference is not timed
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for a, b in spans:
            window = torch.from_numpy(ids[a:b])[None]
            out.append(model(input_ids=window).logits[0].float().numpy())
    return out


def measure(logits_of, ids: np.ndarray, spans, reference: list[np.ndarray]) -> dict:
    """A row's figures: :class:`QualityTally` over every window, and the largest |Δ logit|."""
    from tfgraph.verify.quality_metrics import QualityTally

    tally, worst = QualityTally(), 0.0
    for (a, b), ref in zip(spans, reference, strict=True):
        got = logits_of(ids[a:b])
        worst = max(worst, float(np.abs(got - ref).max()))
        tally.add(ref, got, ids[a + 1 : b + 1])
    return {**tally.figures(), "max_abs_logit_diff": worst}


# ------------------------------------------------------------------ building rows
def build(row: Row, model_dir: Path, work: Path, llama: Path | None) -> Path:
    """The row's artifact (reused when ``work`` has it): a directory or a ``.gguf`` file."""
    if row.engine == "tfgraph":
        return _export(row, model_dir, work / "tfgraph" / row.name.replace(" ", "_"))
    if row.engine == "genai":
        algo, block = row.peer
        return peers.build_genai(model_dir, work / "genai" / f"{algo}-b{block}", algo, block)
    return peers.build_gguf(llama, model_dir, work / "gguf")[row.peer[0]]


def _export(row: Row, model_dir: Path, out: Path) -> Path:
    import tfgraph
    from tfgraph.options import ExportOptions

    known = {f.name for f in dataclasses.fields(ExportOptions)}
    missing = sorted(set(row.fields) - known)
    if missing:
        raise LookupError(f"this tfgraph's ExportOptions has no {', '.join(missing)}")
    if not (out / "report.json").is_file():
        tfgraph.export(str(model_dir), out, kv_cache=True, **row.fields)
    if not json.loads((out / "report.json").read_text())["parity"]["passed"]:
        raise RuntimeError(f"{row.name}: the export failed parity ({out}); no quality row for it")
    return out


def logits_function(row: Row, llama: Path | None):
    """(row's logits of one window's ids → (T, V) float32, close)."""
    if row.engine == "genai":
        runner = peers.GenaiLogits(row.path)
        return runner, runner.close
    if row.engine == "llama.cpp":
        runner = peers.GgufLogits(llama, row.path, WINDOW)
        return runner, runner.close
    from tfgraph.runtime import CachedDecoder, open_runner

    decoder = CachedDecoder(open_runner(row.path, threads=peers.THREADS))

    def prefill(window: np.ndarray) -> np.ndarray:
        cache = decoder.empty_cache(1, len(window))
        logits, _ = decoder.step(window[None], cache)
        return np.asarray(logits[0], np.float32)

    return prefill, lambda: None


def size_mb(path: Path) -> float:
    """The model files' bytes in MB (10⁶): ``.onnx``, external data, ``.gguf``."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    model = [p for p in files if p.suffix in (".onnx", ".data", ".gguf", ".onnx_data", ".bin")]
    return sum(p.stat().st_size for p in model) / 1e6


def measure_rows(rows, model_dir, work, llama, ids, spans, reference, progress) -> None:
    """Build each row and measure its figures into ``row.result`` (a failure is recorded)."""
    for row in rows:
        progress(f"quality: {row.name}")
        start = time.perf_counter()
        try:
            row.path = build(row, model_dir, work, llama)
            logits_of, close = logits_function(row, llama)
            try:
                row.result = measure(logits_of, ids, spans, reference)
            finally:
                close()
            row.result["size_mb"] = round(size_mb(row.path), 2)
        except LookupError as exc:
            row.result = {"skipped": str(exc)}
        except Exception as exc:  # noqa: BLE001 - recorded, the other rows still run
            logger.exception("quality row %s failed", row.name)
            row.result = {"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"}
        row.result["seconds"] = round(time.perf_counter() - start, 1)
        logger.info("quality: %s %s", row.name, row.result)


def time_rows(rows: list[Row], llama: Path | None, rounds: int, progress) -> None:
    """Decode step of every measured row: rounds interleaved across rows (module docstring)."""
    timed = [row for row in rows if row.path is not None and "ppl" in row.result]
    if row_f32 := [r for r in timed if r.name == "llama.cpp f32"]:
        timed.remove(row_f32[0])  # a sanity row: f16 is llama.cpp's unquantized format
    samples = {row.name: [] for row in timed}
    engines = {"tfgraph": "tfgraph", "genai": "genai", "llama.cpp": "gguf"}
    for round_ in range(rounds):
        progress(f"quality: decode timing, round {round_ + 1} of {rounds}")
        for row in timed:
            try:
                ms = peers.decode_step_ms(engines[row.engine], row.path, llama)
            except Exception as exc:  # noqa: BLE001 - recorded, the other rows still run
                row.result["decode_error"] = str(exc)[:200]
                continue
            samples[row.name].append(ms)
    for row in timed:
        if samples[row.name]:
            row.result["decode_ms"] = round(statistics.median(samples[row.name]), 2)
            row.result["decode_ms_rounds"] = [round(ms, 2) for ms in samples[row.name]]


# ------------------------------------------------------------------ the run
def bench(
    *,
    model_dir: Path = MODEL,
    text: Path | None = None,
    work: Path,
    llama: Path | None = None,
    max_tokens: int | None = None,
    rounds: int = 3,
    quick: bool = False,
    progress=lambda line: None,
) -> dict:
    """Measure every row (module docstring); → the JSON result."""
    start = time.perf_counter()
    text = text or model_dir / "heldout.txt"
    work.mkdir(parents=True, exist_ok=True)
    llama = peers.llama_cpp_dir(llama)
    rows = tfgraph_rows(calibration_text(work / "calibration.txt")) + peer_rows(llama)
    rows = quick_rows(rows) if quick else rows
    ids = text_ids(model_dir, text, max_tokens)
    spans = windows(len(ids), WINDOW)
    progress(f"quality: fp32 eager reference over {len(spans)} windows")
    reference = reference_logits(model_dir, ids, spans)
    measure_rows(rows, model_dir, work, llama, ids, spans, reference, progress)
    reference_ppl = next((r.result["ppl_ref"] for r in rows if "ppl_ref" in r.result), None)
    time_rows(rows, llama, rounds, progress)
    return {
        "date": datetime.date.today().isoformat(),
        "model": _shown(model_dir),
        "text": _shown(text),
        "tokens": int(len(ids)),
        "window": WINDOW,
        "windows": len(spans),
        "reference": {"what": "fp32 eager (transformers LlamaForCausalLM)", "ppl": reference_ppl},
        "calibration": "the first training files of train_reference.corpus_files(), "
        f"{CALIBRATION_CHARS} characters (never heldout.txt)",
        "decode": f"ms per step at past {peers.PROMPT}..{peers.PROMPT + peers.STEPS - 1}, batch 1, "
        f"{peers.THREADS} threads, median of steps, median of {rounds} interleaved rounds",
        "llama_cpp": str(llama) if llama else "not built: rows skipped",
        "rows": [
            {"name": r.name, "engine": r.engine, "options": r.fields or list(r.peer), **r.result}
            for r in rows
        ],
        "seconds": round(time.perf_counter() - start, 1),
    }


def _shown(path: Path) -> str:
    """``path`` relative to the repository when inside it (the JSON is committed)."""
    root = Path(__file__).resolve().parents[1]
    path = Path(path).resolve()
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def markdown(result: dict) -> str:
    """The table of ``result``: one line per row."""
    lines = [
        f"Quality on `{result['model']}` over `{result['text']}` ({result['tokens']} tokens, "
        f"{result['windows']} windows of {result['window']}); fp32 eager perplexity "
        f"{(result['reference']['ppl'] or float('nan')):.3f}. Decode: {result['decode']}.",
        "",
        "| row | engine | size MB | decode ms | PPL | ΔPPL | ΔPPL % | KL mean | KL max | top-1 % "
        "| max abs Δlogit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if "ppl" not in row:
            note = row.get("skipped") or row.get("error", "")
            lines.append(f"| {row['name']} | {row['engine']} | {note} |" + " |" * 8)
            continue
        decode = f"{row['decode_ms']:.2f}" if "decode_ms" in row else "—"
        lines.append(
            f"| {row['name']} | {row['engine']} | {row['size_mb']:.1f} | {decode} "
            f"| {row['ppl']:.3f} | {row['delta_ppl']:+.3f} | {row['delta_ppl_pct']:+.2f} "
            f"| {row['kl_mean']:.5f} | {row['kl_max']:.3f} | {100 * row['top1']:.2f} "
            f"| {row['max_abs_logit_diff']:.3g} |"
        )
    return "\n".join(lines) + "\n"


def run(quick: bool, workdir: Path, progress=lambda step: None) -> dict:
    """The ``quality`` section of ``python -m tfgraph bench``: full runs only (like
    ``norm_folding``: its ~25 exports take tens of minutes on 2 cores); llama.cpp's rows when
    ``$TFGRAPH_LLAMA_CPP`` names a build."""
    if quick:
        return {
            "skipped": "full runs only (python -m tfgraph.bench.quality --quick for a few rows)"
        }
    return bench(work=workdir, llama=None, rounds=3, progress=progress)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--text", type=Path, help="default: the model's heldout.txt")
    parser.add_argument("--max-tokens", type=int, help="only the text's first N tokens")
    parser.add_argument("--llama-cpp", type=Path, help=f"llama.cpp (default ${peers.LLAMA_ENV})")
    parser.add_argument("--work", type=Path, default=Path("quality-work"))
    parser.add_argument("--rounds", type=int, default=3, help="decode timing rounds")
    parser.add_argument("--quick", action="store_true", help="a few rows only")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/quality.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = {"command": "python -m tfgraph.bench.quality " + " ".join(argv or sys.argv[1:])}
    result |= bench(
        model_dir=args.model,
        text=args.text,
        work=args.work,
        llama=args.llama_cpp,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        quick=args.quick,
        progress=logger.info,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    logger.info("wrote %s and %s", args.out, args.out.with_suffix(".md"))


if __name__ == "__main__":
    main()
