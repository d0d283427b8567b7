"""The eager reference of a weight-quantized artifact, streamed from the checkpoint.

For a checkpoint bound lazily (:mod:`tfgraph.sources.streamed`) the reference is the same
streamed model, with the quantized parameters read from the ``MatMulNBits`` weights instead of
the checkpoint: each is dequantized (``(q − zero_point) · scale``, as the kernel computes) when
its block is about to run and dropped after, so the reference holds no more than a layer.

Which parameter a quantized weight came from is read off the graph, not found by content: a
weight bound from the checkpoint names its parameter, a transposed (``Linear``) or packed
(Q/K/V) weight names its sources (:mod:`tfgraph.passes.lazy_weights`). A head tied to the
embedding is untied in the reference, as in the graph: the head computes with its dequantized
weight, the embedding with its own (dequantized from ``GatherBlockQuantized`` at int4, the
checkpoint's otherwise).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import torch
from torch import nn

from tfgraph.errors import TfgraphError
from tfgraph.exporters.ort.weights.activations import fake_quantize
from tfgraph.exporters.ort.weights.chunked_reference import swap_large
from tfgraph.exporters.ort.weights.dequantize import dequantize_rows
from tfgraph.exporters.ort.weights.gather_nbits import dequantize_table
from tfgraph.passes.lazy_weights import DERIVED
from tfgraph.sources.streamed import PARAMETER, empty_model

logger = logging.getLogger(__name__)

_WRAPPER = "model."  # the source's wrapper holds the Hugging Face model as ``model``


def is_streamed(source) -> bool:
    return getattr(getattr(source, "binder", None), "streamed", None) is not None


def placements(quantized: list) -> list[dict]:
    """``{node, parameter, columns, transposed}`` per column block of each quantized weight
    (the report's ``weights.parameters``), from the weights' provenance."""
    out = []
    for node, weight in quantized:
        col = 0
        for name, flipped, width in _blocks(weight.const_value):
            out.append(
                {
                    "node": node.name,
                    "parameter": name,
                    "columns": [col, col + width],
                    "transposed": flipped,
                    **({"embedding": True} if node.op_type == "GatherBlockQuantized" else {}),
                }
            )
            col += width
    return out


def _blocks(tensor) -> list[tuple[str, bool, int]]:
    """(parameter, transposed, columns) of a (K, N) weight, left to right."""
    width = int(tensor.shape[-1])
    name = tensor.meta.get(PARAMETER)
    if name is not None:
        return [(name, False, width)]  # used as stored (GPT-2's Conv1D)
    made = tensor.meta.get(DERIVED)
    if made is not None:
        op, arg, sources = made
        if op == "transpose" and tuple(arg) == (1, 0):
            inner = sources[0].meta.get(PARAMETER)
            if inner is not None:
                return [(inner, True, width)]  # a Linear's (out, in) weight
        if op == "cast":  # converted to fp16/bf16: the same parameter
            return _blocks(sources[0])
        if op == "concat" and arg in (1, -1):
            return [b for s in sources for b in _blocks(s)]
    raise TfgraphError(
        f"cannot tell which checkpoint tensor quantized weight '{tensor.name}' comes from, so "
        "the streamed reference would be wrong; report this with the model's config.json"
    )


class _Dequantized(Mapping):
    """Parameter name → its dequantized value, computed when accelerate loads it."""

    def __init__(self, placed: dict[str, dict], nodes: dict, initializers) -> None:
        self._placed, self._nodes, self._initializers = placed, nodes, initializers

    def __getitem__(self, name: str) -> torch.Tensor:
        """Only the parameter's own rows, dequantized into one fresh tensor (a packed Q/K/V
        reads its node three times; a 250k-word head is never held twice)."""
        entry = self._placed[name]
        node = self._nodes[entry["node"]]
        if entry.get("embedding"):  # a GatherBlockQuantized table, (rows, width) as stored
            return torch.from_numpy(dequantize_table(node, self._initializers))
        c0, c1 = entry["columns"]
        rows = dequantize_rows(node, self._initializers, (c0, c1))  # a Linear's (out, in)
        return rows if entry["transposed"] else rows.T.contiguous()

    def __deepcopy__(self, memo) -> _Dequantized:
        """Shared, not copied: a read-only view of the artifact's nodes (the reference's fp16
        copy, :meth:`tfgraph.sources.model.ModelSource.converted`, reads the same bytes)."""
        return self

    def __contains__(self, name) -> bool:  # Mapping's own would compute the value
        return name in self._placed

    def __iter__(self):
        return iter(self._placed)

    def __len__(self) -> int:
        return len(self._placed)


class ModuleActivationQuantizer:
    """Accuracy level 4 in a streamed model: the input of each module whose weight is
    quantized is fake-quantized per block (its weights are reloaded every pass, so they are
    matched by module, not by storage)."""

    def __init__(self, blocks: dict[nn.Module, int]) -> None:
        self.enabled = True
        for module, block in blocks.items():
            module.register_forward_pre_hook(self._hook(block))

    def _hook(self, block: int):
        def quantize(_module, args):
            if not self.enabled or not args:
                return None
            return (fake_quantize(args[0], block), *args[1:])

        return quantize


def streamed_dequantized(source, placed: list[dict], nodes: dict, initializers):
    """``source`` whose streamed model reads the placed parameters dequantized from the
    ``MatMulNBits`` ``nodes`` (their weights in ``initializers``)."""
    streamed = source.binder.streamed
    probe = empty_model(streamed.cls, streamed.config, streamed.extra)
    owners = {n: type(probe.get_submodule(n.rpartition(".")[0])) for n, _ in _named(probe)}
    shared = _aliases(probe)
    by_param: dict[str, dict] = {}
    untie = []
    for entry in placed:
        name = entry["parameter"].removeprefix(_WRAPPER)
        aliases = shared.get(name, [name])
        heads = [a for a in aliases if not issubclass(owners[a], nn.Embedding)]
        tables = [a for a in aliases if issubclass(owners[a], nn.Embedding)]
        if entry.get("embedding"):
            if not tables:
                raise TfgraphError(f"quantized table of '{name}' is not an embedding's")
            target = tables[0]
        else:
            if not heads:
                raise TfgraphError(f"quantized weight of '{name}' is an embedding's table alone")
            target = heads[0]
        untie += heads[:1] if len(aliases) > 1 else []  # head and table: each its own values
        by_param[target] = entry
    del probe
    overrides = _Dequantized(by_param, nodes, initializers)
    model = streamed.model(overrides=overrides, untie=tuple(dict.fromkeys(untie)))
    swap_large(model, by_param, nodes, initializers)  # a 250k-word head/table, in pieces
    wrapper = type(source.module)(model, source.output_names[0]).eval()
    blocks = {
        model.get_submodule(name.rpartition(".")[0]): nodes[e["node"]].attributes.get_int(
            "block_size"
        )
        for name, e in by_param.items()
        if nodes[e["node"]].attributes.get_int("accuracy_level", 0) == 4
    }
    if blocks:
        wrapper._tfgraph_activation_quantizer = ModuleActivationQuantizer(blocks)
    logger.info("streamed eager reference: %d parameters read dequantized", len(by_param))
    return dataclasses.replace(source, module=wrapper, info=dict(source.info))


def _named(model: nn.Module):
    return model.named_parameters(remove_duplicate=False)


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    groups: dict[int, list[str]] = {}
    for name, param in _named(model):
        groups.setdefault(id(param), []).append(name)
    return {name: names for names in groups.values() for name in names}
