"""How the ``exporters`` section feeds and times a graph: the shared settings (threads, prefill
length, pasts, encoder length), each graph's inputs read from the file, and the fastest of
several fresh-process medians (:func:`tfgraph.bench.ort_probe.probe`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tfgraph.bench.ort_probe import probe

THREADS = 2
PREFILL = 512
PASTS = (128, 512, 1016)
ENCODER_LENGTH = 512
STATIC_CAPACITY = max(PASTS) + 8  # a static cache's buffers: the generation's capacity
TRIALS = 3  # fresh processes per measurement; the fastest median is kept
QUICK_TRIALS = 1  # a quick run's fresh processes per measurement


def graph_inputs(path: Path) -> list[tuple[str, str, list]]:
    """(name, numpy dtype, dims) of each input of the graph in ``path``; a dim is its value
    or its symbolic name. The weights are not loaded."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    types = {1: "float32", 7: "int64", 6: "int32", 10: "float16"}
    return [
        (
            i.name,
            types.get(i.type.tensor_type.elem_type, "float32"),
            [
                d.dim_value if d.HasField("dim_value") else d.dim_param
                for d in i.type.tensor_type.shape.dim
            ],
        )
        for i in model.graph.input
    ]


def node_count(path: Path) -> int:
    """The nodes of the graph in ``path`` as written (its weights not loaded)."""
    import onnx

    return len(onnx.load(str(path), load_external_data=False).graph.node)


def kv_shape(dims: list, batch: int, length: int, head_size: int | None = None) -> list[int]:
    """A KV tensor's shape; transformers' exporter writes static head dims as dim params
    ("4"), the builder leaves the head size symbolic (its config states it)."""
    size = head_size if head_size is not None else int(dims[3])
    return [batch, int(dims[1]), length, size]


def time_graph(
    path: Path,
    inputs: dict,
    bind: dict | None,
    repeats: int,
    kernels_only: bool = False,
    trials: int = TRIALS,
) -> float:
    """The lowest of ``trials`` (:data:`TRIALS`) medians, each from a fresh process: on these
    shared machines one process's median moved ±25% between identical runs (measured).
    ``kernels_only``: the graph's attention kernels alone, on the inputs the graph gave them."""
    return min(
        probe(path, inputs, repeats=repeats, threads=THREADS, bind=bind, kernels_only=kernels_only)[
            "seconds"
        ]
        for _ in range(trials)
    )


def time_graphs(graphs, repeats: int, trials: int = TRIALS) -> float:
    """One graph's time, or the sum over a list of them (a T5 prefill: encoder + first step)."""
    if isinstance(graphs, tuple):
        return time_graph(*graphs, repeats, trials=trials)
    return sum(time_graph(*g, repeats, trials=trials) for g in graphs)


def failure_line(exc: Exception) -> str:
    """One line: a probe's own last stderr line rather than its command line."""
    if isinstance(exc, subprocess.CalledProcessError):
        tail = [line for line in (exc.stderr or "").splitlines() if line.strip()][-1:] or [""]
        return f"probe exit status {exc.returncode}: {tail[0][:300]}"
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
