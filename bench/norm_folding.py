"""Prefill latency of a GPT-2-sized preset before and after norm folding (ONNX Runtime, CPU).

Exports ``gpt2-small`` with the ``cleanup`` pipeline (norms left as traced: ReduceMean, Sub,
Pow, Add, Sqrt, Reciprocal, Mul per norm) and with ``default`` (norms folded into
LayerNormalization / SkipLayerNormalization), then times both in fresh processes that do not
import torch, alternating, with ONNX Runtime's own graph optimizations off (what our pass
alone buys) and on (what a user gets; ORT then fuses LayerNorm itself too).

    python bench/norm_folding.py [--out docs/bench/norm_folding.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import tfgraph
from tfgraph.models.norms import LayerNorm

SEQS = (128, 512)


class NormStack(nn.Module):
    """Only what folding touches: GPT-2-small's 25 LayerNorms with their residual adds
    (``x = x + LN(x)·0.5``, the residual Add feeding the next norm), d = 768."""

    input_names = ("input_ids",)
    output_names = ("hidden",)

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50257, 768)
        self.norms = nn.ModuleList(LayerNorm(768) for _ in range(25))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for norm in self.norms:
            x = x + 0.5 * norm(x)
        return x

    def example_inputs(self, batch, seq, generator):
        return {"input_ids": torch.randint(0, 50257, (batch, seq), generator=generator)}

    def dynamic_axes(self):
        return {"input_ids": {0: "batch", 1: "sequence"}}


def _time(model: Path, opt: str, threads: int) -> dict:
    timer = Path(__file__).with_name("ort_timer.py")
    cmd = [
        sys.executable,
        str(timer),
        str(model),
        *map(str, SEQS),
        "--threads",
        str(threads),
        "--opt",
        opt,
        "--vocab",
        "50257",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def _ratios(rows: dict) -> dict:
    return {
        f"ort-opt-{opt}/round-{r}": {
            seq: rows[f"cleanup/ort-opt-{opt}/round-{r}"][seq]
            / rows[f"default/ort-opt-{opt}/round-{r}"][seq]
            for seq in SEQS
        }
        for opt in ("none", "all")
        for r in (1, 2)
    }


def run(quick: bool, workdir: Path, threads: int = 2, progress=lambda step: None) -> dict:
    """The ``norm_folding`` section (full runs only: GPT-2-small twice per pipeline)."""
    if quick:
        return {"skipped": "full runs only (python -m tfgraph bench)"}
    arts, stack = {}, {}
    for pipeline in ("cleanup", "default"):
        progress(f"norm folding: export {pipeline}")
        result = tfgraph.export("gpt2-small", workdir / f"norm-{pipeline}", pipeline=pipeline)
        assert result.passed, result.report["parity"]
        norm = result.report["fusions"]["norm"]
        arts[pipeline] = (workdir / f"norm-{pipeline}" / "model.onnx", norm)
        source = tfgraph.from_module(NormStack().eval(), origin="bench:norm-stack")
        out = workdir / f"norm-stack-{pipeline}"
        assert tfgraph.export(source, out, pipeline=pipeline).passed
        stack[pipeline] = out / "model.onnx"
    rows, stack_rows = {}, {}
    for round_ in (1, 2):  # alternate, twice: the spread between rounds is the noise
        for opt in ("none", "all"):
            progress(f"norm folding: round {round_}, ORT optimizations {opt}")
            for pipeline, (path, _) in arts.items():
                key = f"{pipeline}/ort-opt-{opt}/round-{round_}"
                rows[key] = _time(path, opt, threads)
                stack_rows[key] = _time(stack[pipeline], opt, threads)
    return {
        "model": "gpt2-small (12 layers, d=768, 124M parameters, random init)",
        "batch": 1,
        "threads": threads,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "norms": {p: {"fused": n["fused"], "total": n["total"]} for p, (_, n) in arts.items()},
        "median_seconds": rows,
        "norm_stack_median_seconds": stack_rows,
        "speedup_folded_vs_unfolded": _ratios(rows),
        "norm_stack_speedup_folded_vs_unfolded": _ratios(stack_rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("docs/bench/norm_folding.json"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = run(False, Path(tmp), args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
