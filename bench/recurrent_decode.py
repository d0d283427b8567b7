"""Decode step of a Qwen3.5-style model against the past length: recurrent layers keep a state
of fixed size, so their step is flat in the past; attention layers read a KV cache that grows.

Two Hugging Face ``Qwen3_5TextConfig`` models with random weights (nothing downloaded), both 4
layers, d 256: ``linear`` (4 Gated DeltaNet layers) and ``hybrid`` (Qwen3.5's pattern: 3
Gated DeltaNet layers, then 1 gated full-attention layer). Each is exported with ``tfgraph
export --kv-cache`` (``ort``: ``com.microsoft.LinearAttention`` and ``CausalConvWithState``).
For each past P in :data:`PASTS`, a prefill of P tokens, then the median wall time of
:data:`STEPS` one-token decode steps through :class:`tfgraph.runtime.CachedDecoder`. Hugging
Face eager with its own cache (``model(..., past_key_values=cache)``, one token) runs the same
steps in the same process, with ``torch.set_num_threads(THREADS)``.

    python bench/recurrent_decode.py [--out docs/bench/recurrent_decode.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

THREADS = 2
PASTS = (16, 128, 512)
STEPS = 20
WIDTH = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_value_heads": 8,
    "linear_num_key_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
}
MODELS = {
    "linear": ["linear_attention"] * 4,
    "hybrid": ["linear_attention"] * 3 + ["full_attention"],
}


def _build(layers: list[str], out: Path):
    import torch
    import transformers

    config = transformers.Qwen3_5TextConfig(
        num_hidden_layers=len(layers), layer_types=layers, **WIDTH
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    model.save_pretrained(out)
    return model


def _ours(artifact: Path) -> dict[int, float]:
    from tfgraph.runtime import CachedDecoder, Session

    decoder = CachedDecoder(Session(artifact))
    times = {}
    for past in PASTS:
        cache = decoder.empty_cache(1, past + STEPS + 1)
        _, cache = decoder.step(np.full((1, past), 5, np.int64), cache)
        runs = []
        for i in range(STEPS):
            start = time.perf_counter()
            _, cache = decoder.step(np.full((1, 1), 7 + i, np.int64), cache)
            runs.append(time.perf_counter() - start)
        times[past] = statistics.median(runs) * 1e3
    return times


def _eager(model) -> dict[int, float] | str:
    """Hugging Face's cached steps, or why they do not run (transformers 5.25 refuses a cache
    of linear-attention layers only: ``get_mask_sizes`` wants an attention layer)."""
    import torch

    try:
        return _eager_steps(model, torch)
    except ValueError as exc:
        return f"Hugging Face eager with a cache fails: {str(exc).splitlines()[0]}"


def _eager_steps(model, torch) -> dict[int, float]:
    torch.set_num_threads(THREADS)
    times = {}
    with torch.no_grad():
        for past in PASTS:
            out = model(input_ids=torch.full((1, past), 5), use_cache=True)
            cache = out.past_key_values  # the model returns it by this name
            runs = []
            for i in range(STEPS):
                start = time.perf_counter()
                out = model(input_ids=torch.full((1, 1), 7 + i), cache=cache)
                cache = out.past_key_values  # the model returns it by this name
                runs.append(time.perf_counter() - start)
            times[past] = statistics.median(runs) * 1e3
    return times


def run(out: Path | None = None) -> dict:
    import tfgraph

    results = {"threads": THREADS, "pasts": list(PASTS), "steps": STEPS, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, layers in MODELS.items():
            hf = Path(tmp) / name
            model = _build(layers, hf)
            tfgraph.export(str(hf), Path(tmp) / f"{name}-cached", kv_cache=True, target="ort")
            ours = _ours(Path(tmp) / f"{name}-cached")
            eager = _eager(model)
            results["models"][name] = {
                "layers": layers,
                "tfgraph_ms": ours,
                "hf_eager_ms": eager,
                "tfgraph_flatness": ours[PASTS[-1]] / ours[PASTS[0]],
                "speedup_vs_hf_eager": (
                    {p: eager[p] / ours[p] for p in PASTS} if isinstance(eager, dict) else None
                ),
            }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = run(args.out)
    print("model   past  tfgraph ms  HF eager ms  speedup")
    for name, entry in results["models"].items():
        eager = entry["hf_eager_ms"]
        for past in PASTS:
            ours = entry["tfgraph_ms"][past]
            if isinstance(eager, dict):
                ratio = eager[past] / ours
                print(f"{name:7} {past:5} {ours:10.2f} {eager[past]:12.2f} {ratio:8.1f}x")
            else:
                print(f"{name:7} {past:5} {ours:10.2f}            -        -")
        if not isinstance(eager, dict):
            print(f"{name}: {eager}")
        flat = entry["tfgraph_flatness"]
        print(f"{name}: step at past {PASTS[-1]} / past {PASTS[0]} = {flat:.2f}")


if __name__ == "__main__":
    main()
