"""Before any slow work: will the artifact fit on the disk, and could it be opened here?

The artifact's size is estimated from the model's parameters and the chosen format (fp32 4
bytes a weight, fp16/bf16 2, int4 half a byte plus a scale, and half a byte of zero point when
asymmetric, per block; embedding tables too at int4, else in the activation precision).
Opening it takes about its size in memory again (ONNX Runtime reads or maps the weights, and
prepacks MatMulNBits ones), while the streamed eager reference holds one module at a time in
fp32 — at most the largest weight (a 250k-word vocabulary's 4 GB at width 4096). An export
that could not finish is refused in one line, with the figure and a format that fits.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from torch import nn

from tfgraph.errors import TfgraphError

logger = logging.getLogger(__name__)

GiB = 1024**3


def _size(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / 1024**2:.1f} MiB"


OPEN_FACTOR = 1.25  # session memory per artifact byte (measured: fp32 1.1B 1.05, int4 1.2)
_BITS = {"int4": 4, "int8": 8, "mixed": 5}  # mixed: int4 and --int8-share of int8, rounded up


def estimate_bytes(
    module: nn.Module,
    precision: str,
    weights: str | None,
    block: int,
    symmetric: bool,
    embeddings: bool = True,
) -> int:
    """Bytes of the artifact's weights (embedding tables int4 too at ``weights='int4'`` unless
    ``embeddings`` is false)."""
    float_bytes = 4 if precision == "fp32" else 2
    total = 0
    seen: set[int] = set()
    for owner in module.modules():
        for param in owner.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            n = param.numel()
            table = isinstance(owner, nn.Embedding)
            if weights and param.dim() == 2 and (not table or (embeddings and weights == "int4")):
                bits = _BITS[weights]
                blocks = n / block
                total += int(n * bits / 8 + blocks * float_bytes + (0 if symmetric else blocks / 2))
            else:
                total += n * float_bytes
    return total


def available_memory() -> int | None:
    """Bytes of memory this process could still take: MemAvailable, under a cgroup limit."""
    found = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            found = min(found or int(limit), int(limit) - used)
    except (OSError, ValueError):
        pass
    return found


def check_budget(source, options, out_dir: Path) -> dict:
    """Refuse an export whose artifact would not fit on the disk at ``out_dir`` or could not be
    opened in the memory available; the figures, for the report."""
    module = source.trace_module or source.module
    size = estimate_bytes(
        module,
        options.precision,
        options.weights,
        options.block_size,
        options.symmetric,
        options.quantize_embeddings,
    )
    figures = {"estimated_artifact_bytes": size}
    parent = out_dir.resolve().parent
    free = shutil.disk_usage(parent if parent.exists() else Path(os.getcwd())).free
    figures["disk_free_bytes"] = free
    if size > free:
        raise TfgraphError(
            f"the artifact needs about {_size(size)} on disk and {parent} has "
            f"{_size(free)} free: free space, or write it elsewhere with -o"
        )
    memory = available_memory()
    if memory is None:
        return figures
    figures["memory_available_bytes"] = memory
    if options.precision != "fp32":
        # the precision stage finds its fp32 islands by running the fp32 graph in ONNX Runtime
        fp32 = estimate_bytes(module, "fp32", None, options.block_size, options.symmetric)
        if fp32 * 2 * OPEN_FACTOR > memory:
            raise TfgraphError(
                f"--precision {options.precision} measures its fp32 islands by running the fp32 "
                f"graph (about {_size(fp32)}) in ONNX Runtime, which needs about "
                f"{_size(fp32 * 2 * OPEN_FACTOR)} of the {_size(memory)} available here; "
                "export fp32 with --weights int4 or int8 instead"
            )
    largest = _largest_parameter(module) * 4  # the streamed reference's fp32 copy of it
    figures["reference_peak_bytes"] = largest
    needed = size * OPEN_FACTOR + largest
    if needed > memory:
        what = f"--weights {options.weights}" if options.weights else options.precision
        smaller = _fits(module, options, memory)
        advice = f"; use {smaller} instead" if smaller else ""
        raise TfgraphError(
            f"the {what} artifact (about {_size(size)}) could not be opened in the "
            f"{_size(memory)} of memory available here beside the eager reference's largest "
            f"weight in fp32 (about {_size(needed)} in all){advice}"
        )
    return figures


def _largest_parameter(module: nn.Module) -> int:
    """Elements of the largest parameter (a 250k-word vocabulary: 1.0e9 at width 4096): the
    eager reference holds it whole in fp32 while its module runs, beside the session."""
    return max((p.numel() for p in module.parameters()), default=0)


def _fits(module, options, memory: int) -> str | None:
    """The first format, smallest last, whose artifact could be opened here."""
    for precision, weights, text in (
        ("fp32", "int8", "--weights int8"),
        ("fp32", "int4", "--weights int4"),
    ):
        size = estimate_bytes(
            module,
            precision,
            weights,
            options.block_size,
            options.symmetric,
            options.quantize_embeddings,
        )
        if size * OPEN_FACTOR + _largest_parameter(module) * 4 <= memory:
            return f"{text} (about {_size(size)})"
    return None
