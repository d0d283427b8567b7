"""Calibration for the weight methods that need data: each quantized MatMul's input Hessian
``H = 2/n Σ xᵀx`` (GPTQ, ``--method gptq``) and its diagonal ``E[x_k²]`` (``--weights mixed``'s
sensitivity), from the eager fp32 model run on ``--calibration-text``.

The inputs are caught by forward hooks on the module that owns each quantized weight's parameter
(a ``Linear``; which parameter a MatMul weight came from is read off the graph for a streamed
checkpoint, found by content otherwise, as the eager reference does). Weights that read the same
input (a layer's q/k/v, gate/up) share one Hessian.

**Streamed**: a 7B's Hessians do not fit in memory (down_proj's 14336² alone is 1.6 GB in
float64), so :class:`Calibrator` computes them in groups of consecutive modules (graph order,
the order the lazy weights are written in) within a byte budget: the first weight of a group to
ask for its Hessian runs the calibration pass with hooks on that group's modules only, keeps
their Hessians and drops the previous group's. Each group is computed once when weights are
asked for in order; a weight asked for out of order recomputes its group (correct, slower).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch

from tfgraph.errors import TfgraphError

logger = logging.getLogger(__name__)

DEFAULT_TOKENS = 2048  # 8 windows of 256 tokens
WINDOW = 256
DEFAULT_BUDGET = 2 << 30  # bytes of Hessians held at once


def calibration_windows(source, text: str | Path, tokens: int = DEFAULT_TOKENS) -> list[dict]:
    """The source's inputs over the first ``tokens`` tokens of the text file ``text``, in
    windows of :data:`WINDOW` tokens (fewer where the model's context is shorter)."""
    path = Path(text)
    if not path.is_file():
        raise TfgraphError(f"--calibration-text {text}: no such file (give a UTF-8 text file)")
    if "input_ids" not in source.input_names:
        raise TfgraphError(
            "--calibration-text needs a model that takes input_ids (a text decoder): this one "
            f"takes {', '.join(source.input_names)}"
        )
    ids = _tokenizer(source)(path.read_text(encoding="utf-8"))["input_ids"][:tokens]
    if len(ids) < 2:
        raise TfgraphError(f"--calibration-text {text}: fewer than 2 tokens (give more text)")
    config = getattr(getattr(source.module, "model", None), "config", None)
    window = min(WINDOW, getattr(config, "max_position_embeddings", None) or WINDOW)
    windows = []
    for start in range(0, len(ids), window):
        chunk = torch.tensor(ids[start : start + window], dtype=torch.long)[None]
        inputs = source.inputs(1, chunk.shape[1])
        inputs["input_ids"] = chunk
        windows.append(inputs)
    logger.info("calibration: %d tokens in %d windows from %s", len(ids), len(windows), path)
    return windows


def _tokenizer(source):
    if source.tokenizer is not None:
        return source.tokenizer
    if source.origin.startswith("hf:"):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(source.origin.removeprefix("hf:"))
        except (OSError, ValueError) as error:
            raise TfgraphError(
                f"--calibration-text: cannot load the model's tokenizer ({error}); give a model "
                "directory with its tokenizer files"
            ) from error
    raise TfgraphError(
        f"--calibration-text needs the model's tokenizer; {source.origin} has none (export a "
        "Hugging Face directory with its tokenizer, or pass tokenizer= to export())"
    )


def weight_modules(source, quantized: list, locate) -> dict[str, str]:
    """MatMul node name → the name (in ``source.module``) of the module whose parameter its
    weight is (a packed Q/K/V: its first block's; all read the same input). ``locate``:
    :func:`tfgraph.exporters.ort.weights.quantize.locate` (finds an in-memory module's
    parameters by content; handed in, as quantize imports this module)."""
    from tfgraph.exporters.ort.weights.streamed_reference import is_streamed, placements

    if is_streamed(source):
        placed = placements(quantized)
    else:
        originals = {n.name: (w.const_value.numpy().astype(np.float32), None) for n, w in quantized}
        placed = locate(source.module, originals)
    modules: dict[str, str] = {}
    for entry in placed:
        modules.setdefault(entry["node"], entry["parameter"].rpartition(".")[0])
    return modules


class Calibrator:
    """Hessians (and their diagonals) of the inputs of ``modules`` (names in
    ``source.module``, in the order they will be asked for) over the calibration ``windows``,
    computed in groups within ``budget`` bytes (module doc)."""

    def __init__(self, source, windows: list[dict], modules: list[str], budget=DEFAULT_BUDGET):
        self.source, self.windows, self.budget = source, windows, budget
        self.order = list(dict.fromkeys(modules))
        self._held: dict[str, np.ndarray] = {}
        self._alias: dict[str, str] = {}
        self.passes = 0

    def _width(self, name: str) -> int:
        param = self.source.module.get_submodule(name).weight
        linear = isinstance(self.source.module.get_submodule(name), torch.nn.Linear)
        return int(param.shape[1] if linear else param.shape[0])

    def _group(self, name: str) -> list[str]:
        """The modules from ``name`` on whose Hessians fit the budget (at least one)."""
        start = self.order.index(name)
        group, held = [], 0
        for other in self.order[start:]:
            size = self._width(other) ** 2 * 8
            if group and held + size > self.budget:
                break
            group.append(other)
            held += size
        return group

    def hessian(self, name: str) -> np.ndarray:
        """``2/n Σ xᵀx`` (K, K) float64 of module ``name``'s input over the calibration tokens."""
        if self._alias.get(name) not in self._held:
            group = self._group(name)
            self._held = {}
            self._alias = {}
            sums, self._alias = self._run(group, diagonal=False)
            self._held = sums
            logger.info(
                "calibration pass %d: %d Hessians (%s to %s), %.1f MiB",
                self.passes,
                len(group),
                group[0],
                group[-1],
                sum(h.nbytes for h in sums.values()) / (1 << 20),
            )
        return self._held[self._alias[name]]

    def diagonals(self) -> dict[str, np.ndarray]:
        """``E[x_k²]`` (K,) of every module's input, in one pass."""
        sums, alias = self._run(self.order, diagonal=True)
        return {name: sums[alias[name]] / 2 for name in self.order}

    def _run(self, names: list[str], diagonal: bool) -> tuple[dict, dict]:
        """One calibration pass hooking ``names``: (accumulated ``2/n Σ xᵀx`` or its diagonal
        per distinct input, module → the module whose input it shares)."""
        sums: dict[str, np.ndarray] = {}
        counts: dict[str, int] = {}
        alias: dict[str, str] = {}
        seen: dict[int, tuple[str, torch.Tensor]] = {}

        def hook(name):
            def catch(_module, args):
                x = args[0]
                first = seen.get(id(x))
                if first is not None and first[1] is x:
                    alias[name] = first[0]
                    return
                seen[id(x)] = (name, x)
                alias[name] = name
                rows = x.detach().reshape(-1, x.shape[-1]).double()
                part = (rows * rows).sum(0) if diagonal else rows.T @ rows
                sums[name] = sums.get(name, 0) + part.numpy()
                counts[name] = counts.get(name, 0) + rows.shape[0]

            return catch

        module = self.source.module
        handles = [module.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
        try:
            for inputs in self.windows:
                seen.clear()
                self.source.eager(inputs)
        finally:
            for handle in handles:
                handle.remove()
        self.passes += 1
        missing = sorted(set(names) - set(alias))
        if missing:
            raise TfgraphError(
                f"calibration: module '{missing[0]}' never ran on the calibration text, so its "
                "weight has no Hessian; report this with the model's config.json"
            )
        return {k: 2 * v / counts[k] for k, v in sums.items()}, alias


def budget_groups(calibrator: Calibrator) -> int:
    """How many calibration passes asking for every Hessian in order takes (for the report)."""
    count, index = 0, 0
    while index < len(calibrator.order):
        index += len(calibrator._group(calibrator.order[index]))
        count += 1
    return count


def tokens_of(windows: list[dict]) -> int:
    return int(sum(math.prod(w["input_ids"].shape) for w in windows))
