"""The KV cache of a *merged* attention: one softmax over the decoder's own keys and the
encoder's, as T5Gemma 2's decoder attends (``T5Gemma2MergedAttention``).

Such a layer's canonical ``tfgraph.Attention`` reads

- ``K = Concat(k_self, k_enc, axis=2)`` and ``V = Concat(v_self, v_enc, axis=2)`` (either
  order): ``k_self``/``v_self`` token values of the decoder (B, Hkv, T, d), ``k_enc``/``v_enc``
  computed from the encoder alone (B, Hkv, S_enc, d);
- a bias (B|1, 1, T, T + S_enc) from the machinery: the decoder's causal (and window) mask over
  the self keys, the encoder's padding mask over the others. Its key length is not T, so
  :mod:`.classify_attention_bias` keeps it as ``additive`` with ``causal=0``: the bias carries
  the causality, and every target lowers it as a biased attention with S ≠ T.

:class:`~.insert_kv_cache.InsertKVCachePass` caches only the self part: ``k_self`` becomes
``Concat(past, k_self)`` (the present, ``present.{i}.key``), so K is
``Concat(Concat(past, new), k_enc)``; the bias is machinery, recomputed at L = past + T and cut
to its last T query rows like any decoder's mask, so its self block covers the L cached keys
and its encoder block stays. The encoder parts are named cross K/V of the layer
(:mod:`.split_encoder` moves them to the encoder graph). The op keeps ``cached=0`` and
``causal=0``: its K is not ``Concat(past, new)``, which appending kernels take apart.

A merged layer is cached only when its bias, evaluated (``evaluate_biases``) at two lengths,
masks every later self key: new tokens must not change earlier ones. Per-row past lengths
(in-flight batching) are refused: a slot's padded encoder keys would need a slot mask inside
the merged bias.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tfgraph.passes.recognize.attention.classify_bias import (
    MASKED,
    SIZES,
    Subgraphs,
    evaluate_biases,
)
from tfgraph.passes.rewrite_utils import dims_of

logger = logging.getLogger(__name__)

BIAS_SLOT = 3
ROWS_REFUSED = (
    "merged self/cross attention: a slot's padded encoder keys would need a slot mask inside "
    "the merged bias"
)


@dataclass
class MergedKV:
    """K or V of a merged layer: ``concat`` = Concat(self part, encoder part) along axis 2."""

    concat: ir.Node
    self_index: int  # the input of ``concat`` that is the decoder's own part

    @property
    def own(self) -> ir.Value:
        return self.concat.inputs[self.self_index]

    @property
    def encoder(self) -> ir.Value:
        return self.concat.inputs[1 - self.self_index]


def _split(value: ir.Value, analysis) -> MergedKV | None:
    node = value.producer()
    if node is None or node.op_type != "Concat" or node.domain not in ("", "ai.onnx"):
        return None
    if len(node.inputs) != 2 or value.shape is None or len(value.shape) != 4:
        return None
    if node.attributes.get_int("axis", 0) % 4 != 2 or len(value.uses()) != 1:
        return None
    if value.is_graph_output():
        return None
    for index in (0, 1):
        own, other = node.inputs[index], node.inputs[1 - index]
        if own is None or other is None or own.shape is None or len(own.shape) != 4:
            continue
        if own not in analysis.token or dims_of(own)[2] != analysis.seq:
            continue
        if other in analysis.token or other in analysis.machinery:
            continue  # not from the encoder alone
        if other.is_graph_input() or other.const_value is not None:
            continue
        return MergedKV(node, index)
    return None


def merged_layers(analysis) -> dict[ir.Node, tuple[MergedKV, MergedKV]]:
    """Attention nodes whose Q is the decoder's tokens and whose K and V are each the
    decoder's own keys/values concatenated with the encoder's, in the same order."""
    found = {}
    for node in analysis.graph:
        if node.domain != "tfgraph" or node.op_type != "Attention":
            continue
        q = node.inputs[0]
        if q not in analysis.token or q.shape is None or len(q.shape) != 4:
            continue
        if dims_of(q)[2] != analysis.seq:
            continue
        k, v = _split(node.inputs[1], analysis), _split(node.inputs[2], analysis)
        if k is None or v is None or k.self_index != v.self_index:
            continue
        found[node] = (k, v)
    return found


def check_merged(model: ir.Model, analysis, error: type[Exception]) -> None:
    """Raise ``error`` unless every merged layer's bias is machinery that masks every self key
    after its query (at both probe lengths) and its K/V head count and size are static."""
    subgraphs, verdicts = Subgraphs(model), {}  # layers share a mask: evaluated once
    for node, (k, v) in analysis.merged.items():
        for what, part in (("K", k.own), ("V", v.own)):
            if not all(isinstance(d, int) for d in dims_of(part)[1::2]):
                raise error(
                    f"{node.name}: the merged attention's {what} has no static head count or size"
                )
        bias = node.inputs[BIAS_SLOT] if len(node.inputs) > BIAS_SLOT else None
        if bias is None or bias not in analysis.machinery:
            raise error(
                f"{node.name}: a merged self/cross attention without a mask computed from "
                "shapes and masks alone: its causality cannot be checked"
            )
        key = (bias.name, k.self_index)
        if key not in verdicts:
            evaluated = [
                evaluate_biases(model, [bias], size, False, subgraphs=subgraphs)[0]
                for size in SIZES
            ]
            verdicts[key] = all(
                e is not None and _masks_later_self_keys(e, k.self_index) for e in evaluated
            )
        if not verdicts[key]:
            raise error(
                f"{node.name}: the merged self/cross attention's mask does not mask every later "
                "decoder key, so new tokens would change earlier ones; a KV cache does not apply"
            )


def _masks_later_self_keys(bias, self_index: int) -> bool:
    """In (…, T, T + S) ``bias``, the T self keys (first or last) are masked after the query."""
    e = np.asarray(bias)
    if e.ndim < 2:
        return False
    t = e.shape[-2]
    if t < 2 or e.shape[-1] <= t:
        return False
    own = e[..., :t] if self_index == 0 else e[..., e.shape[-1] - t :]
    later = np.triu(np.ones((t, t), bool), k=1)
    return bool((own[..., later] <= MASKED).all())


def past_shape_source(analysis, node: ir.Node, slot: int) -> ir.Value:
    """The value the layer's past for K (slot 1) or V (slot 2) takes its dims from."""
    merged = analysis.merged.get(node)
    return node.inputs[slot] if merged is None else merged[slot - 1].own


def cache_reader(analysis, node: ir.Node, slot: int) -> tuple[ir.Node, int]:
    """(node, input) that reads the new K (slot 1) or V (slot 2) and gets ``Concat(past,
    new)`` instead: the attention itself, or a merged layer's Concat with the encoder's."""
    merged = analysis.merged.get(node)
    if merged is None:
        return node, slot
    part = merged[slot - 1]
    return part.concat, part.self_index


def after_cache(analysis, node: ir.Node) -> None:
    """A merged layer's K and V now span the past too: their stale length is dropped."""
    for part in analysis.merged.get(node, ()):
        out = part.concat.outputs[0]
        out.shape = ir.Shape([None if i == 2 else d for i, d in enumerate(out.shape)])


def merged_cross_kv(analysis, node: ir.Node) -> tuple[ir.Value, ir.Value] | None:
    """The encoder's K and V of a merged layer (its cross K/V, to be named), else None.

    Each is read through an ``Identity`` of its own: the encoder's K is a canonical op's output
    (T5Gemma 2's ``k_norm``), which lowering replaces by a new value, name and all."""
    merged = analysis.merged.get(node)
    if merged is None:
        return None
    named = []
    for part in merged:
        identity = ir.node("Identity", [part.encoder])
        out = identity.outputs[0]
        out.type, out.shape = part.encoder.type, part.encoder.shape
        identity.metadata_props.update(part.concat.metadata_props)
        analysis.graph.insert_before(part.concat, identity)
        part.concat.replace_input_with(1 - part.self_index, out)
        named.append(out)
    return named[0], named[1]
