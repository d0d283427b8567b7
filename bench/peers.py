"""tfgraph against what a user would reach for instead, on the same model, input and threads.

The model (``gpt2-small`` from the zoo, random init; ``gpt-tiny`` in quick mode, where the
unfused and tfgraph exports are the prefill section's: :mod:`tfgraph.bench.shared`) is exported
once with ``pipeline="none"``: the traced graph, nothing fused. Each peer starts from it:

- ``unfused``: that export itself;
- ``tfgraph``: ``tfgraph.export(..., pipeline="default", target="ort")`` of the same module;
- ``ort_transformers_optimizer``: ``onnxruntime.transformers.optimizer.optimize_model`` with
  ``model_type="gpt2"`` (its Python fusions after ORT's basic optimizations, ``opt_level=1``,
  the level ORT picks for GPT-2);
- ``onnxscript_optimize_for_ort``: ``onnxscript.rewriter.ort_fusions.optimize_for_ort`` on the
  export loaded with ``onnx_ir``.

For each: the op histogram of the resulting graph, its fused attention and norm ops, the max
abs error of its logits against eager PyTorch at :data:`PARITY_SHAPE` (ONNX Runtime in this
process, untimed), and prefill latency and peak RSS at each sequence length, batch 1, measured
by :func:`tfgraph.bench.ort_probe.probe` in a fresh torch-free process per peer and length
(peers interleaved per length). ONNX Runtime's own graph optimizations run at session load for
every peer alike (all levels, ``SkipLayerNormFusion`` off: its CPU kernel is slower, and a
plain session would fire it on peers' graphs; tfgraph's ``ort`` graphs never let it fire).

A peer that cannot be imported is ``{"available": false, "note": why}``; one that raises while
building its model is the same with ``error`` (one line); a measurement that raises leaves its
value out (``None`` for the parity error) and is listed in the peer's ``errors``.

    python -m tfgraph.bench.peers [--quick] [--threads 2] [--out peers.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tfgraph.exporters.ort import ops as ort_ops

logger = logging.getLogger(__name__)

PEERS = ("tfgraph", "unfused", "ort_transformers_optimizer", "onnxscript_optimize_for_ort")
# fused ops counted in any domain: ONNX Runtime's (named by the ``ort`` target) and ONNX's own
ATTENTION_OPS = frozenset(
    {ort_ops.ATTENTION, ort_ops.MULTI_HEAD_ATTENTION, ort_ops.GROUP_QUERY_ATTENTION}
)
NORM_OPS = frozenset(
    {
        "LayerNormalization",
        ort_ops.SIMPLIFIED_LAYER_NORM,
        ort_ops.SKIP_LAYER_NORM,
        ort_ops.SKIP_SIMPLIFIED_LAYER_NORM,
        "RMSNormalization",
    }
)
GELU_OPS = frozenset({ort_ops.GELU, ort_ops.FAST_GELU, ort_ops.BIAS_GELU})
PARITY_SHAPE = (1, 16)  # (batch, sequence) of the parity check against eager PyTorch
ORT_OPT_LEVEL = 1  # optimize_model's default for model_type="gpt2"


@dataclass(frozen=True)
class Setup:
    preset: str
    seqs: tuple[int, ...]
    repeats: int


FULL = Setup("gpt2-small", (128, 512), 5)
QUICK = Setup("gpt-tiny", (128,), 3)


class Unavailable(Exception):
    """The peer's package is not importable here."""


@dataclass
class Context:
    """What every peer builder gets: the module's source, its unfused export, a directory."""

    source: object  # tfgraph.ModelSource
    config: object  # tfgraph.models.ModelConfig
    unfused: Path
    workdir: Path


@dataclass
class Built:
    """A peer's model file, what was done to make it, and anything it reported."""

    path: Path
    note: str
    extra: dict = field(default_factory=dict)


def _no_progress(message: str) -> None:
    pass


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


# --- peers ---------------------------------------------------------------------------------


def _build_unfused(ctx: Context) -> Built:
    return Built(ctx.unfused, "the traced graph as exported (pipeline='none'), nothing fused")


def _build_tfgraph(ctx: Context) -> Built:
    from tfgraph.bench import shared

    result = shared.export(ctx.source, ctx.workdir / "tfgraph", pipeline="default", target="ort")
    fusions = {
        kind: {k: counts.get(k) for k in ("fused", "total")}
        for kind, counts in result.report["fusions"].items()
        if isinstance(counts, dict)
    }
    return Built(
        result.out_dir / "model.onnx",
        "tfgraph.export(pipeline='default', target='ort')",
        {"export_parity_passed": result.passed, "fusion_stats": fusions},
    )


def _build_ort_optimizer(ctx: Context) -> Built:
    try:
        from onnxruntime.transformers.optimizer import optimize_model
    except ImportError as exc:
        raise Unavailable(f"onnxruntime.transformers not importable ({_one_line(exc)})") from exc
    optimized = optimize_model(
        str(ctx.unfused),
        model_type="gpt2",
        num_heads=ctx.config.n_heads,
        hidden_size=ctx.config.d_model,
        opt_level=ORT_OPT_LEVEL,
    )
    path = ctx.workdir / "ort_transformers_optimizer.onnx"
    optimized.save_model_to_file(str(path))
    stats = getattr(optimized, "get_fused_operator_statistics", None)
    extra = {"fusion_stats": {k: v for k, v in stats().items() if v}} if stats else {}
    return Built(
        path,
        f"optimize_model(model_type='gpt2', opt_level={ORT_OPT_LEVEL}) on the unfused export",
        extra,
    )


def _build_onnxscript(ctx: Context) -> Built:
    try:
        import onnx_ir as ir
        from onnxscript.rewriter.ort_fusions import optimize_for_ort
    except ImportError as exc:
        raise Unavailable(f"onnxscript ort_fusions not importable ({_one_line(exc)})") from exc
    result = optimize_for_ort(ir.load(str(ctx.unfused)))
    model, stats = result if isinstance(result, tuple) else (result, None)
    path = ctx.workdir / "onnxscript_optimize_for_ort.onnx"
    ir.save(model, str(path))
    extra = {"fusion_stats": {k: v for k, v in stats.items() if v}} if stats else {}
    return Built(path, "optimize_for_ort(onnx_ir.load(unfused export))", extra)


BUILDERS: dict[str, Callable[[Context], Built]] = {
    "tfgraph": _build_tfgraph,
    "unfused": _build_unfused,
    "ort_transformers_optimizer": _build_ort_optimizer,
    "onnxscript_optimize_for_ort": _build_onnxscript,
}


# --- measurements --------------------------------------------------------------------------


def op_histogram(path: Path) -> dict[str, int]:
    """Nodes per op type, ``domain::op_type`` outside the default domain (as ``tfgraph
    inspect`` counts them), most frequent first."""
    import onnx_ir as ir

    from tfgraph.passes.pipeline.fusions import op_histogram as histogram

    counts = histogram(ir.load(str(path)))
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def count_ops(ops: dict[str, int], names: frozenset[str]) -> int:
    """Nodes whose op type (in any domain) is one of ``names``."""
    return sum(n for key, n in ops.items() if key.rsplit("::", 1)[-1] in names)


def _max_abs_err(path: Path, inputs: dict, want, threads: int) -> float:
    """Max |ORT − eager| of the first output (the logits), ORT in this process."""
    import numpy as np

    from tfgraph.runtime import Session

    session = Session(path, threads=threads)
    got = session.run(inputs)[session.output_names[0]]
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))


def _measure_static(entry: dict, built: Built, reference: tuple[dict, object], threads: int):
    """Histogram, fused op counts and parity of one built peer, into ``entry``."""
    ops = op_histogram(built.path)
    entry.update(
        ops=ops,
        fused_attention=count_ops(ops, ATTENTION_OPS),
        fused_norms=count_ops(ops, NORM_OPS),
        fused_gelu=count_ops(ops, GELU_OPS),
    )
    try:
        entry["max_abs_err_vs_eager"] = _max_abs_err(built.path, *reference, threads)
    except Exception as exc:
        entry["max_abs_err_vs_eager"] = None
        entry["errors"].append(f"parity: {_one_line(exc)}")


def _probe_inputs(seq: int, vocab: int) -> dict:
    return {"input_ids": {"shape": [1, seq], "dtype": "int64", "high": vocab}}


def _measure_latency(entries: dict, paths: dict, setup: Setup, vocab: int, threads: int, progress):
    """Prefill latency per length, peers interleaved within a length (drift hits all alike)."""
    from tfgraph.bench.ort_probe import probe

    for seq in setup.seqs:
        for name, path in paths.items():
            progress(f"{name}: prefill at {seq}")
            entry = entries[name]
            try:
                out = probe(path, _probe_inputs(seq, vocab), repeats=setup.repeats, threads=threads)
            except Exception as exc:
                detail = getattr(exc, "stderr", None) or ""
                logger.warning("peers: %s probe at %d failed: %s %s", name, seq, exc, detail[-500:])
                entry["errors"].append(f"probe at {seq}: {_one_line(exc)}")
                continue
            entry["seconds"][str(seq)] = out["seconds"]
            entry["peak_rss_mib"][str(seq)] = out["peak_rss_mib"]
            entry["run_extra_rss_mib"][str(seq)] = out["run_extra_rss_mib"]


def ratios(peers: dict) -> dict:
    """``peer / tfgraph`` prefill latency per length (> 1: tfgraph is faster)."""
    base = peers.get("tfgraph", {}).get("seconds") or {}
    out = {}
    for name, entry in peers.items():
        if name == "tfgraph" or not entry.get("available"):
            continue
        row = {
            seq: {"peer_over_tfgraph_latency": seconds / base[seq]}
            for seq, seconds in entry["seconds"].items()
            if base.get(seq)
        }
        if row:
            out[name] = row
    return out


# --- the run -------------------------------------------------------------------------------


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return path.name


def _unavailable(note: str, error: str | None = None) -> dict:
    entry = {"available": False, "note": note}
    if error is not None:
        entry["error"] = error
    return entry


def _build_peer(name: str, ctx: Context) -> tuple[dict, Built | None]:
    """Build one peer's model; a failure becomes an unavailable entry, never an exception."""
    try:
        built = BUILDERS[name](ctx)
    except Unavailable as exc:
        return _unavailable(str(exc)), None
    except Exception as exc:
        logger.warning("peers: %s failed", name, exc_info=True)
        return _unavailable(f"failed: {_one_line(exc)}", _one_line(exc)), None
    entry = {
        "available": True,
        "note": built.note,
        "model_file": _relative(built.path, ctx.workdir),
        **built.extra,
        "seconds": {},
        "peak_rss_mib": {},
        "run_extra_rss_mib": {},
        "errors": [],
    }
    return entry, built


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for package in ("onnxruntime", "onnxscript", "onnx-ir", "onnx", "torch"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


def _context(setup: Setup, workdir: Path, progress) -> Context:
    """In a quick suite, the source and both exports are prefill's (:mod:`tfgraph.bench.shared`:
    the same preset, the same options)."""
    import tfgraph
    from tfgraph.bench import shared
    from tfgraph.bench.prefill import source_key
    from tfgraph.models.presets import PRESETS, build

    source = shared.source(
        source_key(setup.preset, {}),
        lambda: tfgraph.from_module(build(setup.preset), origin=f"preset:{setup.preset}"),
    )
    progress(f"export {setup.preset} unfused (pipeline none)")
    result = shared.export(source, workdir / "unfused", pipeline="none", target="ort")
    return Context(source, PRESETS[setup.preset], result.out_dir / "model.onnx", workdir)


def _reference(source) -> tuple[dict, object]:
    """Inputs at PARITY_SHAPE and the eager logits for them."""
    inputs = source.inputs(*PARITY_SHAPE)
    want = source.eager(inputs)[source.output_names[0]].float().numpy()
    return inputs, want


def run(
    quick: bool,
    workdir: Path,
    threads: int = 2,
    progress: Callable[[str], None] = _no_progress,
) -> dict:
    """Build and measure every peer of :data:`PEERS` under ``workdir``."""
    from tfgraph.bench import shared

    setup = QUICK if quick else FULL
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with shared.scope(quick):
        return _run(setup, workdir, threads, progress)


def _run(setup: Setup, workdir: Path, threads: int, progress) -> dict:
    ctx = _context(setup, workdir, progress)
    reference = _reference(ctx.source)
    peers, paths = {}, {}
    for name in PEERS:
        progress(f"{name}: build")
        entry, built = _build_peer(name, ctx)
        if built is not None:
            _measure_static(entry, built, reference, threads)
            paths[name] = built.path
            logger.info("peers: %s: %s", name, entry["ops"])
        peers[name] = entry
        gc.collect()
    _measure_latency(peers, paths, setup, ctx.config.vocab_size, threads, progress)
    return {
        "model": setup.preset,
        "threads": threads,
        "seqs": list(setup.seqs),
        "repeats": setup.repeats,
        "parity_shape": list(PARITY_SHAPE),
        "config": {k: getattr(ctx.config, k) for k in ("n_layers", "d_model", "n_heads")},
        "versions": _versions(),
        "peers": peers,
        "ratios": ratios(peers),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.preset}, seqs {QUICK.seqs}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("peers.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)  # this module's messages, not every pass's
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.quick, Path(tmp), threads=args.threads, progress=logger.info)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
