"""A padding bias that is exactly "key j masked where ``attention_mask[b, j] == 0``" (plus the
causal/window pattern the kernel applies itself) becomes three ops on the mask input.

Hugging Face builds its padding mask with index grids (``Range``, ``Expand``, ``GatherND``
over ``attention_mask``, ``And`` with the causal pattern, ``Where``): about 30 ops per graph,
which a cached decode step ran at every token (measured: ~8% of a tiny Mistral step). When
:class:`~.classify_attention_bias.ClassifyAttentionBiasPass` finds a bias of kind
``padding``, this module evaluates it once more with a left-padded, a right-padded and an
unpadded row and compares it, on every query row that is not padding itself (those outputs
are never used), with ``masked(b, i, j) = mask[b, j] == 0 or (causal and j > i) or (window and
i − j ≥ w)``; the window comes from the same long check as a dropped causal mask. If it is that
exactly, the bias input becomes ``Unsqueeze(Where(Equal(mask, 0), lowest, 0), [1, 2])``
(B, 1, 1, S), and ``causal``/``window`` stay on the canonical op.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from tfgraph.passes.probe_feeds import probe_feeds
from tfgraph.passes.rewrite_utils import add_initializer

logger = logging.getLogger(__name__)

MASKED = -1e8
COMPACT_KEY = "tfgraph.key_padding_bias"  # the rebuilt bias the node reads
# node metadata: the padding bias, computed for a row left-padded by p, is the unpadded row's
# bias moved by p along queries and keys (up to a constant per query row): measured by
# shifts_with_left_padding; a cached graph's rows at their own lengths read it so
LEFT_PAD_SHIFT_KEY = "tfgraph.bias_shifts_with_left_padding"
SIZE = 11
PAD = 4  # the left-padded probe row's padding (_evaluate)


def _mask_input(model: ir.Model, subgraphs, value: ir.Value):
    """The one 2-D attention-mask graph input the bias reads, with its evaluation graph."""
    sub = subgraphs.get(value)
    if sub is None:
        return None, None
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # a probe that fails raises; ORT must not also print it
    session = ort.InferenceSession(sub.SerializeToString(), options)
    wanted = {i.name for i in session.get_inputs()}
    masks = [v for v in model.graph.inputs if v.name in subgraphs.masks and v.name in wanted]
    if len(masks) != 1 or masks[0].shape is None or len(masks[0].shape) != 2:
        return None, None
    return masks[0], (session, sub)


def _evaluate(session_sub, mask_name: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(bias, mask) with a mask of three rows: unpadded, left-padded, right-padded."""
    session, sub = session_sub
    feeds = probe_feeds(sub.graph, SIZE, False, {mask_name}, batch=3)
    wanted = {i.name for i in session.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in wanted}
    rows, length = feeds[mask_name].shape
    if rows != 3 or length < 8:
        return None
    mask = np.ones((3, length), np.int64)
    mask[1, :4] = 0  # left-padded
    mask[2, -3:] = 0  # right-padded
    feeds[mask_name] = mask.astype(feeds[mask_name].dtype)
    return session.run(None, feeds)[0], mask


def shifts_with_left_padding(model, subgraphs, value: ir.Value, done: dict) -> bool:
    """Whether the padding bias ``value`` computes, for a row left-padded by p, the unpadded
    row's bias moved by p along queries and keys: bias_left[…, p + i, p + j] equals
    bias[…, i, j] plus a constant per query row wherever it is finite, and is masked exactly
    where it is (Hugging Face BLOOM's ALiBi from the mask's cumulative sum with its causal and
    padding mask; MPT's). Measured on the probe rows of :func:`_evaluate`."""
    if value.name in done:
        return done[value.name]
    done[value.name] = False
    mask_value, session_sub = _mask_input(model, subgraphs, value)
    evaluated = _evaluate(session_sub, mask_value.name) if mask_value is not None else None
    if evaluated is None:
        return False
    bias, mask = evaluated
    s = mask.shape[1]
    if bias.ndim != 4 or bias.shape[0] != 3 or bias.shape[-2:] != (s, s) or mask[1, PAD] != 1:
        return False
    plain = bias[0, :, : s - PAD, : s - PAD].astype(np.float64)
    moved = bias[1, :, PAD:, PAD:].astype(np.float64)
    if not np.array_equal(plain <= MASKED, moved <= MASKED):
        return False
    finite = plain > MASKED
    diff = np.where(finite, moved - plain, np.nan)
    row = np.nanmean(np.where(finite.any(-1, keepdims=True), diff, 0.0), axis=-1, keepdims=True)
    scale = max(1.0, float(np.abs(plain[finite]).max(initial=0.0)))
    done[value.name] = bool(np.all(np.where(finite, np.abs(diff - row), 0.0) <= 1e-5 * scale))
    return done[value.name]


def _expected(mask: np.ndarray, causal: bool, window: int) -> np.ndarray:
    """masked[b, i, j] of the formula (True where masked)."""
    s = mask.shape[1]
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    masked = np.broadcast_to(mask[:, None, :] == 0, (mask.shape[0], s, s)).copy()
    if causal:
        masked |= j > i
    if window:
        masked |= i - j >= window
    return masked


def compact_key_padding(
    model, subgraphs, node, value, attrs: dict, check_long, done: dict
) -> dict | None:
    """New attrs (``causal``, ``window``) with ``node``'s bias replaced, or None (kept).
    ``done``: the verdict and the rebuilt bias per bias value (layers share one)."""
    if value.name not in done:
        done[value.name] = _verdict(model, subgraphs, node, value, attrs, check_long, done)
    verdict = done[value.name]
    if verdict is None:
        return None
    result, bias = verdict
    node.replace_input_with(3, bias)
    node.metadata_props[COMPACT_KEY] = bias.name
    logger.debug("attention %s: padding bias replaced by the key mask", node.name)
    return result


def _verdict(model, subgraphs, node, value, attrs: dict, check_long, done: dict):
    mask_value, session_sub = _mask_input(model, subgraphs, value)
    if mask_value is None:
        return None
    window = 0
    if attrs["causal"]:
        long = check_long({**attrs, "keep": False, "bias_kind": "none"})
        if long["keep"]:
            return None
        window = long["window"]
    evaluated = _evaluate(session_sub, mask_value.name)
    if evaluated is None:
        return None
    bias, mask = evaluated
    length = mask.shape[1]
    if bias.ndim != 4 or bias.shape[0] != 3 or bias.shape[-2:] != (length, length):
        return None
    want = _expected(mask, bool(attrs["causal"]), window)
    rows = mask[:, None, :, None].astype(bool)  # query rows that are tokens
    got_masked = bias <= MASKED
    if not np.array_equal(np.where(rows, got_masked, False), np.where(rows, want[:, None], False)):
        return None
    if np.any(np.where(rows & ~got_masked, bias, 0) != 0):
        return None  # finite values besides the mask (a position bias)
    key = ("built", mask_value.name, value.dtype)  # one rebuilt bias per mask (GPT-OSS:
    if key not in done:  # sliding and full layers differ only in the window attribute)
        done[key] = build_key_bias(model.graph, node, mask_value, value.dtype)
    bias = done[key]
    return {"causal": attrs["causal"], "window": window}, bias


def build_key_bias(
    graph: ir.Graph, node: ir.Node, mask: ir.Value, dtype: ir.DataType | None
) -> ir.Value:
    """``Unsqueeze(Where(Equal(mask, 0), lowest, 0), [1, 2])`` (B, 1, 1, S) in ``dtype``
    (float when unknown), inserted before ``node``."""
    dtype = dtype or ir.DataType.FLOAT
    np_dtype = dtype.numpy()
    zero_mask = add_initializer(graph, "key_padding_zero", np.zeros((), mask.dtype.numpy()))
    lowest = add_initializer(
        graph, "key_padding_lowest", np.array(np.finfo(np_dtype).min, np_dtype)
    )
    zero = add_initializer(graph, "key_padding_visible", np.zeros((), np_dtype))
    axes = add_initializer(graph, "key_padding_axes", np.array([1, 2], np.int64))
    padded = ir.node("Equal", [mask, zero_mask])
    where = ir.node("Where", [padded.outputs[0], lowest, zero])
    unsqueeze = ir.node("Unsqueeze", [where.outputs[0], axes])
    batch, length = mask.shape[0], mask.shape[1]
    padded.outputs[0].type = ir.TensorType(ir.DataType.BOOL)
    padded.outputs[0].shape = ir.Shape([batch, length])
    where.outputs[0].type = ir.TensorType(dtype)
    where.outputs[0].shape = ir.Shape([batch, length])
    out = unsqueeze.outputs[0]
    out.type, out.shape = ir.TensorType(dtype), ir.Shape([batch, 1, 1, length])
    out.name = f"{mask.name}__key_bias"
    for new in (padded, where, unsqueeze):
        graph.insert_before(node, new)
    return out
