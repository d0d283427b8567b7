"""Classify each attention bias by evaluating it, then state it in the canonical op.

Masks and position biases are computed by subgraphs that depend only on shapes and on the
``attention_mask`` input (DESIGN-NOTES.md); matching every way a library builds them is
fragile. Instead, for each ``tfgraph.Attention`` with a bias input:

1. Extract the subgraph that computes the bias and run it in ONNX Runtime at two sizes, with an
   all-ones ``attention_mask`` and then with one padded key. A bias that reads only the
   *shape* of an activation (SDPA's ``is_causal`` decomposed: a ``Trilu`` mask sized by
   ``Shape(Q)``, ``Shape(K)``) is evaluated with a stand-in of that shape, so it is classified
   even when the activation comes out of a fused op.
2. Classify what it computes (entries ≤ −1e8 count as masked):
   - masked exactly above the diagonal (and, with a window w, where i − j ≥ w), zero elsewhere:
     ``causal=1`` (``window=w``), and the bias input is dropped: the kernel does it in O(n);
   - the same mask plus finite values: ``causal=1`` and the bias kept, ``bias_kind`` ``alibi``
     (linear in i − j per head), ``relative`` (a function of i − j) or ``additive``;
   - nothing masked: all zero → dropped; else ``alibi`` / ``relative`` / ``additive``, kept;
   - it opens later keys when the token ids are one the graph compares them against
     (``input_ids == image_token``), causal otherwise: kept whole, ``bias_kind="prompt_block"``,
     ``causal=0`` (:mod:`.prompt_block`: Gemma 3's image block at the prompt);
   - it changes when a key is padded: kept, ``bias_kind="padding"`` (with ``causal=1`` when
     the unpadded pattern is causal); when it is exactly a key mask of ``attention_mask``
     besides that pattern, it is rebuilt from the mask in three ops
     (:mod:`.key_padding_bias`; the node's metadata says so);
   - it changes with the token ids (Shaw's ``q·r``, computed from activations): kept,
     ``bias_kind="additive"``; a bias computed from a fused op's output is not evaluated,
     but a causal mask it applies is (``causal=1``, the bias kept: :mod:`.causal_within`).
3. Results at the two sizes must agree, where a window ``w`` shows only at sizes > ``w`` (a
   window of 9 looks plainly causal at 7): a disagreement keeps the bias as ``additive``.
4. A mask about to be dropped (causal, nothing else in it) is evaluated once more at a long
   size (:data:`LONG_SIZE`, batch 1) to find a window the short sizes cannot see; a window of
   ``LONG_SIZE`` or more is beyond what is checked (the node's metadata records the size).
   If that evaluation fails, the bias is kept.
5. A node that is causal already (ONNX ``Attention``'s ``is_causal``) stays causal.

The result is a measured fact, so the report can say exactly what each layer's mask is.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir

from tfgraph.contract import (
    ATTENTION_MASK,
    ENCODER_ATTENTION_MASK,
    PROMPT_LENGTH,
    names_with_role,
)
from tfgraph.passes.canonical import DOMAIN, AttentionOp, drop_attention_bias
from tfgraph.passes.probe_feeds import probe_feeds
from tfgraph.passes.recognize.attention.causal_within import mask_candidates
from tfgraph.passes.recognize.attention.key_padding_bias import (
    LEFT_PAD_SHIFT_KEY,
    compact_key_padding,
    shifts_with_left_padding,
)
from tfgraph.passes.recognize.attention.prompt_block import classify_prompt_block, compared_ids

logger = logging.getLogger(__name__)

MASKED = -1e8
CLASSIFIED_KEY = "tfgraph.bias_classified"
SIZES = (7, 11)  # sequence lengths tried; batch is 2
LONG_SIZE = 4100  # the long check of a mask to drop: finds windows up to 4099 (Mistral: 4096)
LONG_BUDGET = LONG_SIZE * LONG_SIZE  # elements of one evaluated bias in the long check
CHECKED_KEY = "tfgraph.window_checked_to"  # sequence length the dropped mask was checked at


class Subgraphs:
    """The model computing each bias, extracted once per value (``onnx_ir``'s ``extract``);
    ``None`` for a bias computed through an op that is not a standard one."""

    def __init__(self, model: ir.Model) -> None:
        self.model = model
        self.masks = frozenset(names_with_role(model, ATTENTION_MASK, ENCODER_ATTENTION_MASK))
        self._done: dict[str, onnx.ModelProto | None] = {}

    def get(self, value: ir.Value) -> onnx.ModelProto | None:
        if value.name not in self._done:
            self._done[value.name] = self._extract(value)
        return self._done[value.name]

    def _extract(self, value: ir.Value) -> onnx.ModelProto | None:
        boundary = _cone(value, cut_shapes=False)
        if boundary is None:  # through a fused op: read only the shapes of what it feeds
            boundary = _cone(value, cut_shapes=True)
        if boundary is None:
            return None
        # every graph input stays an input, so that dims are numbered as in the whole graph;
        # values whose shape alone the bias reads come after them, as inputs of their shape
        inputs = list(self.model.graph.inputs) + [v for v in boundary if not v.is_graph_input()]
        graph = ir.convenience.extract(self.model.graph, inputs, [value])
        return ir.to_proto(ir.Model(graph, ir_version=self.model.ir_version))


def _known_dims(value: ir.Value) -> bool:
    """Every dim a static int or a named symbol: a stand-in of that shape can be fed."""
    return value.shape is not None and all(
        isinstance(d, int) or d.value is not None for d in value.shape
    )


def _cone(value: ir.Value, *, cut_shapes: bool) -> list[ir.Value] | None:
    """Walk back from ``value`` through standard ops; ``None`` if a non-standard op computes
    it. With ``cut_shapes``, a value read only by ``Shape`` (a mask built from the shape of
    Q or K, as SDPA's decomposition builds its causal mask) is not walked through: it is
    returned, to be fed as a stand-in of its (symbolic) shape, whose values the bias cannot
    read. A value whose Shape is read and which is also read as data (``attention_mask``
    sizes GIT's mask and pads it; its embeddings' shape comes out of a fused norm) is walked
    through, not stood in for."""
    seen: set[int] = set()
    shape_only: dict[int, ir.Value] = {}
    data: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        node = v.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.domain not in ("", "ai.onnx"):
            return None
        if cut_shapes and node.op_type == "Shape" and _known_dims(node.inputs[0]):
            shape_only.setdefault(id(node.inputs[0]), node.inputs[0])
            continue
        for i in node.inputs:
            if i is not None:
                data.add(id(i))
                stack.append(i)
    # a value also read as data (``attention_mask``: its Shape sizes the mask, its values pad
    # it) was walked through as data, through standard ops only: it needs no stand-in
    return [v for k, v in shape_only.items() if k not in data]


def evaluate_biases(
    model: ir.Model,
    values: list[ir.Value],
    size: int,
    pad: bool,
    token: int = 0,
    batch: int = 2,
    subgraphs: Subgraphs | None = None,
):
    """The bias tensors at one size, computed by ONNX Runtime; None for a bias that depends on
    something other than shapes and inputs (e.g. on a fused op's output)."""
    import onnxruntime as ort

    subgraphs = Subgraphs(model) if subgraphs is None else subgraphs
    results, done = [], {}  # layers share one mask value: evaluate it once
    for value in values:
        if value.name in done:
            results.append(done[value.name])
            continue
        sub = subgraphs.get(value)
        if sub is None:
            results.append(done.setdefault(value.name, None))
            continue
        options = ort.SessionOptions()
        options.log_severity_level = 4  # a probe that fails raises; ORT must not also print it
        session = ort.InferenceSession(sub.SerializeToString(), options)
        wanted = {i.name for i in session.get_inputs()}
        feeds = probe_feeds(sub.graph, size, pad, subgraphs.masks, token, batch)
        feeds = {k: v for k, v in feeds.items() if k in wanted}
        results.append(done.setdefault(value.name, session.run(None, feeds)[0]))
    return results


def classify(bias: np.ndarray) -> dict:
    """Attributes implied by one evaluated bias (batch row 0), as described above; a bias
    whose rows differ (unpadded: per window of shifted-window attention, whose row 0 may be
    all zero) is never dropped for what row 0 alone says."""
    attrs = _classify_row0(bias)
    e = np.asarray(bias)
    if not attrs["keep"] and e.ndim == 4 and not (e == e[:1]).all():
        return dict(ADDITIVE)
    return attrs


def _classify_row0(bias: np.ndarray) -> dict:
    e = np.asarray(bias, dtype=np.float64)
    e = e[0] if e.ndim == 4 else e  # (H|1, T|1, S)
    while e.ndim < 3:
        e = e[None]
    t, s = e.shape[-2], e.shape[-1]
    masked = e <= MASKED
    finite = np.where(masked, 0.0, e)
    attrs = {"causal": 0, "window": 0, "keep": True}
    if masked.any():
        if t != s or t == 1:
            return {**attrs, "bias_kind": "additive"}
        i = np.arange(t)[:, None]
        j = np.arange(s)[None, :]
        above = j > i
        window = 0
        band = masked & ~above
        if band.any():
            dist = np.broadcast_to(i - j, masked.shape)[band]
            window = int(dist.min())
        expected = above | ((i - j) >= window if window else False)
        if not np.array_equal(masked, np.broadcast_to(expected, masked.shape)):
            return {**attrs, "bias_kind": "additive"}
        attrs.update(causal=1, window=window)
        visible = ~np.broadcast_to(expected, masked.shape)
    else:
        visible = np.ones_like(masked)
    if not np.any(finite[visible]):
        return {**attrs, "keep": False, "bias_kind": "none"}
    return {**attrs, "bias_kind": _position_kind(finite, visible)}


def _position_kind(finite: np.ndarray, visible: np.ndarray) -> str:
    """``alibi``, ``relative`` or ``additive``, judged up to a constant per row (which softmax
    ignores: BLOOM's ALiBi is m·j, the same as −m·(i − j) after the row's own shift)."""
    t, s = finite.shape[-2:]
    if t != s or t < 3:
        return "additive"
    offset = np.arange(t)[:, None] - np.arange(s)[None, :]  # i − j
    linear = True
    for h in range(finite.shape[0]):
        centered = finite[h] - np.diag(finite[h])[:, None]
        seen = visible[h]
        for d in np.unique(offset[seen]):
            vals = centered[(offset == d) & seen]
            if np.ptp(vals) > 1e-5 * (1 + np.abs(vals).max()):
                return "additive"
        dist, vals = offset[seen], centered[seen]
        slope = vals @ dist / max(float(dist @ dist), 1.0)
        if np.abs(vals - slope * dist).max() > 1e-4 * (1 + np.abs(vals).max()):
            linear = False
    return "alibi" if linear else "relative"


class ClassifyAttentionBiasPass(ir.passes.InPlacePass):
    """Set ``causal``, ``window`` and ``bias_kind`` of each biased ``tfgraph.Attention`` from
    its evaluated bias, and drop the bias input where the kernel attributes say it all."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        nodes = [
            n
            for n in model.graph
            if n.domain == DOMAIN
            and n.op_type == "Attention"
            and len(n.inputs) > 3
            and n.inputs[3] is not None
            and CLASSIFIED_KEY not in n.metadata_props
        ]
        if not nodes:
            return ir.passes.PassResult(model, modified=False)
        values = [n.inputs[3] for n in nodes]
        subgraphs = Subgraphs(model)
        runs = [evaluate_biases(model, values, size, False, subgraphs=subgraphs) for size in SIZES]
        padded = evaluate_biases(model, values, SIZES[0], pad=True, subgraphs=subgraphs)
        other_tokens = evaluate_biases(model, values, SIZES[0], False, token=1, subgraphs=subgraphs)
        specials = _with_compared_ids(model, values, subgraphs)
        modified, checked = False, {}  # checked: the long check's result per bias value
        compacted: dict = {}  # the key-padding verdict per bias value
        shifted: dict = {}  # the left-padding verdict per bias value
        for k, node in enumerate(nodes):
            if any(run[k] is None for run in runs):
                if _split_off_mask(model, node, subgraphs, checked):
                    modified = True
                    continue
                if _causal_within(model, node, subgraphs):
                    modified = True
                    continue
                node.metadata_props[CLASSIFIED_KEY] = "not evaluable"
                continue
            attrs = agree([run[k] for run in runs])
            block = classify_prompt_block(
                [r[k] for r in runs], [[r[k] for r in s] for s in specials]
            )
            if block is not None:  # causal but where the step's ids open a block (Gemma 3)
                attrs = block
            elif not np.array_equal(np.asarray(other_tokens[k]), np.asarray(runs[0][k])):
                # depends on the activations (Shaw's q·r): only its mask structure is a fact;
                # a mask of the token ids (T5Gemma's decoder: causal and ids != pad) is causal
                # when every evaluation masks every later key
                causal = all(_masks_later_keys(r[k]) for r in (*runs, other_tokens))
                attrs = {**attrs, "keep": True, "bias_kind": "additive", "causal": int(causal)}
            elif not np.array_equal(np.asarray(padded[k]), np.asarray(runs[0][k])):
                attrs = {**attrs, "keep": True, "bias_kind": "padding"}

                def long_check(a, node=node, k=k):
                    return _check_long(model, subgraphs, node, values[k], a, runs[0][k], checked)

                compact = compact_key_padding(
                    model, subgraphs, node, values[k], attrs, long_check, compacted
                )
                if compact is not None:
                    attrs = {**attrs, **compact}
                elif shifts_with_left_padding(model, subgraphs, values[k], shifted):
                    node.metadata_props[LEFT_PAD_SHIFT_KEY] = "1"
            elif attrs["causal"] and not attrs["keep"]:
                attrs = _check_long(model, subgraphs, node, values[k], attrs, runs[0][k], checked)
            spec = AttentionOp.read(node)
            spec.replace(
                causal=spec.causal or bool(attrs["causal"]),  # is_causal stays
                window=attrs["window"],
                bias_kind=attrs["bias_kind"],
            ).write(node)
            if not attrs["keep"]:
                drop_attention_bias(node)
            node.metadata_props[CLASSIFIED_KEY] = attrs["bias_kind"]
            logger.debug("attention %s: %s", node.name, attrs)
            modified = True
        return ir.passes.PassResult(model, modified=modified)


def _with_compared_ids(model: ir.Model, values: list, subgraphs: Subgraphs) -> list:
    """The biases evaluated at every size with each id the graph compares its tokens against
    (:mod:`.prompt_block`), one list of runs per id, and, where the graph takes a
    ``prompt_length`` (PaliGemma), with every input at the probe's length (the whole probe a
    prompt); a probe that fails is left out (the bias is then classified as before)."""
    probes = [lambda size, t=token: t for token in compared_ids(model)]
    if names_with_role(model, PROMPT_LENGTH):
        probes.append(lambda size: size)
    specials = []
    for token in probes:
        try:
            specials.append(
                [
                    evaluate_biases(model, values, n, False, token=token(n), subgraphs=subgraphs)
                    for n in SIZES
                ]
            )
        except Exception as exc:  # noqa: BLE001 - ids the bias cannot take: not a block mask
            logger.debug("bias probe with token ids %d failed: %s", token(SIZES[0]), exc)
    return specials


def _split_off_mask(model: ir.Model, node: ir.Node, subgraphs: Subgraphs, checked: dict) -> bool:
    """A bias that cannot be evaluated (computed from activations, like Shaw's ``q·r``) but is
    ``Add(term, mask)`` with an evaluable pure causal/window ``mask``: state the mask as
    ``causal``/``window`` and keep only ``term`` as the (``additive``) bias."""
    add = node.inputs[3].producer()
    if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
        return False
    for mask, term in ((add.inputs[1], add.inputs[0]), (add.inputs[0], add.inputs[1])):
        runs = [
            evaluate_biases(model, [mask], size, False, subgraphs=subgraphs)[0] for size in SIZES
        ]
        if any(r is None or np.ndim(r) < 2 for r in runs):
            continue
        if not all(r.shape[-1] == r.shape[-2] for r in runs):
            continue
        attrs = agree(runs)
        if not (attrs["causal"] and not attrs["keep"]):
            continue
        (padded,) = evaluate_biases(model, [mask], SIZES[0], True, subgraphs=subgraphs)
        if not np.array_equal(np.asarray(padded), np.asarray(runs[0])):
            continue  # it masks padding too (Inkling): kept whole, see _causal_within
        attrs = _check_long(model, subgraphs, node, mask, attrs, runs[0], checked)
        if attrs["keep"]:  # the long check did not confirm a pure causal mask
            continue
        spec = AttentionOp.read(node)
        spec.replace(causal=True, window=attrs["window"], bias_kind="additive").write(node)
        node.replace_input_with(3, term)
        node.metadata_props[CLASSIFIED_KEY] = "additive (causal mask split off)"
        logger.debug("attention %s: causal mask split off an activation bias", node.name)
        return True
    return False


def _causal_within(model: ir.Model, node: ir.Node, subgraphs: Subgraphs) -> bool:
    """A bias computed from activations that stays masked wherever an evaluable part of it,
    a causal mask, masks (:mod:`.causal_within`: DSA's top-k indexer inside the causal
    mask): ``causal`` is stated, and the whole bias kept as ``additive``."""
    for part, kind in mask_candidates(node.inputs[3]):
        runs = []
        for size in SIZES:
            (r,) = evaluate_biases(model, [part], size, False, subgraphs=subgraphs)
            if r is None or np.ndim(r) < 2 or r.shape[-1] != r.shape[-2]:
                break
            if kind != "bias":  # a boolean: True where visible (keep) or masked (fill)
                r = np.where(np.asarray(r, bool) == (kind == "keep"), 0.0, -1e9)
            runs.append(r)
        if len(runs) < len(SIZES) or not agree(runs)["causal"]:
            continue
        spec = AttentionOp.read(node)
        spec.replace(causal=True, bias_kind="additive").write(node)
        node.metadata_props[CLASSIFIED_KEY] = "additive (inside a causal mask)"
        logger.debug("attention %s: an activation bias inside a causal mask", node.name)
        return True
    return False


def _masks_later_keys(bias) -> bool:
    """Every key after its query is masked (≤ −1e8) in this evaluated (…, T, T) bias."""
    e = np.asarray(bias)
    if e.ndim < 2 or e.shape[-1] != e.shape[-2] or e.shape[-1] < 2:
        return False
    later = np.triu(np.ones(e.shape[-2:], bool), k=1)
    return bool((e[..., later] <= MASKED).all())


ADDITIVE = {"causal": 0, "window": 0, "keep": True, "bias_kind": "additive"}


def agree(evaluated: list[np.ndarray]) -> dict:
    """One classification from the bias evaluated at several lengths: they must agree, except
    that a window ``w`` is visible only at lengths > ``w`` (below, it looks plainly causal)."""
    found = [classify(e) for e in evaluated]
    same = [{k: v for k, v in f.items() if k != "window"} for f in found]
    if any(f != same[0] for f in same):
        return dict(ADDITIVE)
    windows = {f["window"] for f in found if f["window"]}
    if len(windows) > 1:
        return dict(ADDITIVE)
    window = windows.pop() if windows else 0
    lengths = [np.shape(e)[-2] for e in evaluated]
    if window and any(f["window"] == 0 and t > window for f, t in zip(found, lengths, strict=True)):
        return dict(ADDITIVE)
    return {**found[0], "window": window}


def _check_long(model, subgraphs, node, value, attrs: dict, short: np.ndarray, cache: dict) -> dict:
    """A causal mask about to be dropped, evaluated once more at a long length (batch 1) to see
    a window longer than the short lengths; the bias is kept if that does not confirm it."""
    if value.name not in cache:  # layers share one mask: evaluate it once
        cache[value.name] = _long_window(model, subgraphs, node, value, short)
    window, length = cache[value.name]
    if window is None or (attrs["window"] and window != attrs["window"]):
        logger.info("attention %s: mask not confirmed at length %d; bias kept", node.name, length)
        return dict(ADDITIVE)
    node.metadata_props[CHECKED_KEY] = str(length)
    return {**attrs, "window": window}


def _long_window(model, subgraphs, node, value, short: np.ndarray) -> tuple[int | None, int]:
    """(window at the long length or None, that length)."""
    per_row = int(np.prod(np.shape(short)[-3:])) if np.ndim(short) >= 3 else np.size(short)
    t = np.shape(short)[-2]
    heads = max(per_row // (t * t), 1)
    size = min(LONG_SIZE, int(np.sqrt(LONG_BUDGET / heads)))
    # A graph that cannot run that long (a learned or sinusoidal position table of 128 rows,
    # which SDPA's is_causal mask reaches through Shape(Q)) is checked at half the length,
    # down to above the short lengths: the model runs no longer than that anyway, and the
    # node's metadata records the length checked.
    while True:
        try:
            (long,) = evaluate_biases(model, [value], size - 2, False, batch=1, subgraphs=subgraphs)
            window = None if long is None else mask_window(long)
            return window, int(np.shape(long)[-2]) if long is not None else size
        except Exception as exc:  # noqa: BLE001 - any failure here: try shorter, else keep it
            if size // 2 - 2 <= max(SIZES):
                logger.info("attention %s: long mask check failed (%s)", node.name, exc)
                return None, size
            logger.debug("attention %s: long mask check at %d failed", node.name, size - 2)
            size //= 2


def mask_window(bias: np.ndarray) -> int | None:
    """The window of a pure causal mask (0 when none shows at this length); None when the
    tensor is not exactly causal + window with zeros elsewhere. Works on booleans: cheap at
    thousands of positions."""
    m = np.asarray(bias)
    m = m[0] if m.ndim == 4 else m
    m = m.reshape(-1, *m.shape[-2:])
    t, s = m.shape[-2:]
    if t != s:
        return None
    visible = m > MASKED
    if np.any(np.where(visible, m, 0) != 0):
        return None
    counts = visible.sum(-1)  # (H, T): visible keys per query row
    rows = np.arange(t)
    last = t - 1 - np.argmax(visible[..., ::-1], axis=-1)
    first = np.argmax(visible, axis=-1)
    if not counts.all() or not (last == rows).all() or not (last - first + 1 == counts).all():
        return None  # an empty row, a visible key after the query, or a gap
    width = int(counts.max())
    if not (counts == np.minimum(rows + 1, width)).all():
        return None
    return 0 if width == t else width
