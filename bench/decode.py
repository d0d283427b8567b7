"""Decode speed: tfgraph's KV-cached engine vs eager PyTorch without cache vs Hugging Face
``generate`` with its cache, on the same GPT-2 models, in one run.

Two sizes, both Hugging Face ``GPT2LMHeadModel`` with random weights (nothing downloaded):
``tiny`` (2 layers, d 64, vocab 256) and ``small`` (GPT-2-small's shape: 12 layers, d 768,
vocab 50257, 124 M parameters). Each is saved with ``save_pretrained`` and exported with
``tfgraph export --kv-cache``. Greedy decoding, batch 1, prompt 128 + 128 new tokens (EOS
never stops it). The ONNX Runtime side runs in a fresh process that never imports torch
(ORT's latency was measured 3× worse beside torch's thread pool); PyTorch runs with
``torch.set_num_threads(THREADS)``. Tokens/s = new tokens / wall time of the whole call,
prefill included. Median of ``repeats`` runs after one warm-up. A quick run: ``tiny`` only,
one run after the warm-up, prompt 32 + 32 new tokens (:data:`QUICK_TOKENS`), steps at pasts
128 and 1016.

Also measured: the per-token decode time of the cached engine against the past length (128 …
1016; GPT-2's 1024 positions bound it), and the memory-bandwidth bound of a step: weight
bytes ÷ the machine's copy bandwidth (numpy copy of a 256 MiB buffer, bytes copied per second).

    python bench/decode.py [--quick] [--out docs/bench/decode.json]
    (or as the ``decode`` section of ``python -m tfgraph bench``)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

THREADS = 2
PROMPT, NEW = 128, 128
SIZES = {
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256},
    "small": {},  # GPT2Config defaults: GPT-2 small
}
PROBE = r"""
import json, statistics, sys, time
import numpy as np, onnxruntime as ort
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, generate
path, prompt, new, repeats, threads = sys.argv[1], *map(int, sys.argv[2:6])
pasts = [int(p) for p in sys.argv[6].split(",")]
decoder = CachedDecoder(Session(path, threads=threads))
ids = np.random.default_rng(0).integers(1, 200, prompt).tolist()
config = GenerationConfig(max_new_tokens=new)
times = []
for _ in range(repeats + 1):
    t = time.perf_counter(); out = generate(decoder, [ids], config)
    times.append(time.perf_counter() - t)
assert len(out.tokens[0]) == new
result = {"seconds": statistics.median(times[1:]), "tokens": out.tokens[0]}
for past in pasts:  # one decode step on a cache holding `past` positions
    cache = decoder.empty_cache(1, capacity=past + 1)
    if not decoder.shared:  # a copying cache: past tensors of exactly that length
        rng = np.random.default_rng(1)
        for layer in decoder.layers:
            for meta in layer.values():
                shape = (1, meta.shape[1], past, meta.shape[3])
                cache.values[meta.name] = ort.OrtValue.ortvalue_from_numpy(
                    rng.standard_normal(shape, dtype=np.float32))
    cache.length = past
    token = np.array([[5]], np.int64)
    steps = []
    for _ in range(12):
        t = time.perf_counter(); decoder.step(token, cache); steps.append(time.perf_counter() - t)
    result[f"step_seconds_past_{past}"] = statistics.median(steps[2:])
result["shared_buffer"] = decoder.shared
print(json.dumps(result))
"""


def copy_bandwidth() -> float:
    """Bytes copied per second by numpy on a 256 MiB buffer (median of 5)."""
    src = np.ones(64 * 1024**2, np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(6):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return src.nbytes / statistics.median(times[1:])


PASTS = (128, 256, 512, 1016)
QUICK_TOKENS = (32, 32)  # prompt, new tokens of a quick run


def measure(
    size: str, root: Path, repeats: int, pasts=PASTS, prompt: int = PROMPT, new: int = NEW
) -> dict:
    """One size: the cached engine (a fresh process), eager PyTorch without a cache and HF
    ``generate``, their tokens/s and tokens, and the engine's step against the bandwidth bound."""
    import torch
    import transformers

    from tfgraph.bench import shared

    config = transformers.GPT2Config(**SIZES[size])
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    hf_dir, artifact = root / f"hf-{size}", root / f"tfgraph-{size}"
    model.save_pretrained(hf_dir)
    result = shared.export(str(hf_dir), artifact, kv_cache=True)
    assert result.passed, result.report["parity"]["outputs"]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = _engine(artifact, prompt, new, repeats, pasts)
    timings, tokens = _eager(model, prompt, new, repeats)
    bandwidth = copy_bandwidth()
    bound = weight_bytes / bandwidth
    step_long = engine["step_seconds_past_1016"]
    step_short = engine["step_seconds_past_128"]
    return {
        "layers": config.n_layer,
        "d_model": config.n_embd,
        "vocab": config.vocab_size,
        "weight_bytes": weight_bytes,
        "tokens_per_s": {
            "tfgraph_cached": new / engine["seconds"],
            "eager_no_cache": new / timings["eager_no_cache"],
            "hf_generate": new / timings["hf_generate"],
        },
        "same_tokens_as_hf_generate": engine["tokens"] == tokens["hf_generate"],
        "same_tokens_as_eager": engine["tokens"] == tokens["eager_no_cache"],
        "ratio": {
            "tfgraph_over_hf_generate": timings["hf_generate"] / engine["seconds"],
            "tfgraph_over_eager_no_cache": timings["eager_no_cache"] / engine["seconds"],
        },
        "step_seconds": {"past_128": step_short, "past_1016": step_long},
        "step_seconds_by_past": {str(p): engine[f"step_seconds_past_{p}"] for p in pasts},
        "shared_buffer": engine["shared_buffer"],
        "step_past_1016_over_128": step_long / step_short,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_bound_step_seconds": bound,
        "step_past_128_over_bound": step_short / bound,
    }


def _engine(artifact: Path, prompt: int, new: int, repeats: int, pasts) -> dict:
    """:data:`PROBE`'s result: the cached engine timed in a fresh process without torch
    (its steps at 128, 1016 and ``pasts``)."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            PROBE,
            str(artifact),
            str(prompt),
            str(new),
            str(repeats),
            str(THREADS),
            ",".join(map(str, sorted({128, 1016, *pasts}))),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _eager(model, prompt: int, new: int, repeats: int) -> tuple[dict, dict]:
    """(median seconds, tokens) of eager PyTorch without a cache and of HF ``generate``, on
    the same seeded prompt as the engine's, :data:`THREADS` threads."""
    import torch

    torch.set_num_threads(THREADS)
    ids = torch.tensor([np.random.default_rng(0).integers(1, 200, prompt).tolist()])

    def eager_no_cache() -> list[int]:
        tokens = ids
        with torch.no_grad():
            for _ in range(new):
                logits = model(tokens, use_cache=False).logits[:, -1]
                tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        return tokens[0, prompt:].tolist()

    def hf_generate() -> list[int]:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
        return out[0, prompt:].tolist()

    timings, tokens = {}, {}
    for name, fn in (("eager_no_cache", eager_no_cache), ("hf_generate", hf_generate)):
        runs = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            tokens[name] = fn()
            runs.append(time.perf_counter() - t)
        timings[name] = statistics.median(runs[1:])
    return timings, tokens


def run(quick: bool, workdir: Path, progress=lambda step: None) -> dict:
    """The ``decode`` section: when ``quick``, tiny only, one repeat, prompt and new tokens
    :data:`QUICK_TOKENS` (eager PyTorch without a cache is most of the section's time), steps
    at pasts 128 and 1016."""
    sizes = ["tiny"] if quick else list(SIZES)
    repeats = 1 if quick else 3
    prompt, new = QUICK_TOKENS if quick else (PROMPT, NEW)
    results: dict = {
        "threads": THREADS,
        "prompt": prompt,
        "new_tokens": new,
        "batch": 1,
        "repeats": repeats,
    }
    for size in sizes:
        progress(f"decode {size}")
        pasts = (128, 1016) if quick else PASTS
        results[size] = measure(size, workdir, repeats, pasts, prompt, new)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("docs/bench/decode.json"))
    parser.add_argument("--quick", action="store_true", help="tiny only, 1 repeat, 32 + 32 tokens")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = run(args.quick, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
