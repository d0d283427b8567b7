"""Insert a KV cache into a fused decoder graph, for any model definition.

Runs on canonical ``tfgraph.Attention`` ops (after recognition and bias classification, before
lowering). The graph keeps its inputs and outputs and gains, per causal self-attention layer i
(in graph order):

- inputs ``past_key_values.{i}.key`` / ``.value`` (roles ``past_key`` / ``past_value`` of
  layer i, :mod:`tfgraph.contract`): (batch, kv_heads, past_sequence, head_dim);
- outputs ``present.{i}.key`` / ``.value`` (``present_key`` / ``present_value``): (batch,
  kv_heads, total_sequence, head_dim), the past followed by the new tokens' keys and values
  (what the next step feeds back as past); the canonical op gets ``cached=1``.

Past length 0 is valid, so one graph serves prefill and decode. The ``attention_mask`` input
(by its role) then spans past + new tokens. The cache grows along the sequence axis of the
``token_ids`` input. Cross-attention keys and values (read by a decoder layer's queries,
computed from the encoder alone) are named for :mod:`.split_encoder` by decoder layer.

How positions, masks and biases follow, without knowing how the model computes them:
values are split into

- *token* values: computed from the token inputs (``input_ids``, ``position_ids``, …); their
  sequence axis stays the T new tokens;
- *machinery*: computed from shapes and masks only (position indices, RoPE tables, learned or
  sinusoidal position rows, causal masks, ALiBi and relative biases, padding masks). Every
  length a machinery value took from a token shape becomes L = past + T: the machinery is
  cloned with ``Shape(x)`` of a token value offset by the past length on its sequence axis.

Where machinery meets token data (``Add`` of position rows, ``Mul`` by cos/sin, a bias into the
attention), the clone's query-side sequence axes are sliced to their last T entries: the new
tokens' positions P … L − 1. An attention bias keeps its key axis at L, bottom-right aligned
with the keys ``Concat(past, new)``. Shape arguments of token ops (``Reshape`` targets and the
like) keep T. A bias computed from the tokens (Shaw's ``q·r``, through ``Einsum``/``MatMul``
and elementwise ops) is followed back from the attention's key axis: the machinery it reads
keeps L along the axes that become keys. Positions counted from the token ids (M2M100's
``cumsum(input_ids != pad)``, a cumulative sum of an indicator of the ids) continue from the
past length, as Hugging Face's own cached forward counts them (``+ past_key_values_length``).
A layer that cannot be cached (not causal, an op the
walk cannot follow, unknown shapes) raises :class:`KVCacheError` naming the layer and the
reason (``export`` then writes nothing).

The pass runs in named phases (each logged at debug level): :data:`ANALYSIS` reads the graph
(:mod:`.kv_analysis`, :mod:`.kv_junctions`) and changes nothing but shapes; :data:`KV_CACHE`
then rewrites it (:mod:`.kv_rewrite`), or :data:`STATES_ONLY` for a graph of recurrent layers
only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import onnx_ir as ir
import onnx_ir.passes.common as common

from tfgraph import contract
from tfgraph.passes.cache.encoder_mask import add_encoder_mask
from tfgraph.passes.cache.kv_analysis import (
    Analysis,
    KVCacheError,
    sequence_symbol,
    token_input,
)
from tfgraph.passes.cache.kv_junctions import Junction, find_junctions, key_axes
from tfgraph.passes.cache.kv_rewrite import (
    Rewriter,
    add_pasts,
    add_presents,
    continue_count,
    name_cross_kv,
    refuse_rows,
    rewire_junctions,
    shapes_from_tokens,
    target_tail_from_input,
    widen_key_values,
    widen_masks,
)
from tfgraph.passes.cache.merged_attention_cache import ROWS_REFUSED
from tfgraph.passes.cache.row_lengths import (
    PER_ROW,
    ROW_LENGTHS_FROM_KEY,
    ROW_LENGTHS_KEY,
    RowGather,
)
from tfgraph.passes.cache.token_value_cache import cache_token_value
from tfgraph.passes.provenance import layer_name
from tfgraph.passes.rewrite_utils import LOWERED_FROM_KEY

__all__ = ["InsertKVCachePass", "KVCacheError", "sequence_symbol"]

logger = logging.getLogger(__name__)

STATES_REFUSE_ROWS = "recurrent layers carry one state per row: a slot cannot join mid-batch"


@dataclass
class _Run:
    """What the phases of one run share, filled in phase by phase."""

    model: ir.Model
    row_lengths: bool  # the pass's option: junctions gathered per row where they can be
    seq: str = ""  # the sequence symbol
    reshaped: bool = False  # whether the shape phase changed the graph (by its own account)
    analysis: Analysis | None = None
    states: bool = False  # the graph carries recurrent states
    junction_keys: dict = field(default_factory=dict)  # (node, input) → its key axes
    pasts: list[ir.Value] = field(default_factory=list)
    rewriter: Rewriter | None = None
    rows: RowGather | None = None
    junctions: list[Junction] = field(default_factory=list)


Phase = tuple[str, Callable[[_Run], None]]


# -- analysis: every graph without a cache ---------------------------------------------------


def _sequence_axis(run: _Run) -> None:
    run.seq = sequence_symbol(run.model)


def _shapes(run: _Run) -> None:
    """Shapes of the values the fusion passes created; the token ops' lengths read off the
    tokens, not the mask."""
    inferred = common.ShapeInferencePass()(run.model).modified
    rewired = shapes_from_tokens(run.model, run.seq)
    run.reshaped = inferred or rewired > 0


def _values(run: _Run) -> None:
    run.analysis = Analysis(run.model, run.seq)
    run.states = bool(contract.names_with_role(run.model, *contract.STATE_ROLES))


def _checks(run: _Run) -> None:
    run.analysis.check(states=run.states)


def _key_axes(run: _Run) -> None:
    run.junction_keys = key_axes(run.analysis)
    if run.analysis.cuts and not run.analysis.layers:
        raise KVCacheError("token values read along the key axis need an attention layer")


ANALYSIS: tuple[Phase, ...] = (
    ("sequence axis", _sequence_axis),
    ("shapes", _shapes),
    ("token and machinery values", _values),
    ("layer checks", _checks),
    ("bias key axes", _key_axes),
)


# -- the KV cache ------------------------------------------------------------------------------


def _past_inputs(run: _Run) -> None:
    run.pasts = add_pasts(run.model, run.analysis)


def _past_length(run: _Run) -> None:
    """``Shape(past)[2]``, the past length, first in the graph; the rewriter that clones the
    machinery at past + new."""
    graph = run.model.graph
    shape_node = ir.node("Shape", [run.pasts[0]], {"start": 2, "end": 3})
    graph.insert_before(next(iter(graph)), shape_node)
    run.rewriter = Rewriter(run.analysis, shape_node.outputs[0])


def _row_lengths(run: _Run) -> None:
    """Per-row past lengths where asked and possible (:mod:`.row_lengths`), else the reason."""
    model, analysis = run.model, run.analysis
    if not run.row_lengths:
        return
    if run.states:
        model.metadata_props[ROW_LENGTHS_KEY] = STATES_REFUSE_ROWS
    elif analysis.cuts:
        model.metadata_props[ROW_LENGTHS_KEY] = (
            "a bias reads cached token values (an indexer's keys) of one past length"
        )
    elif (tokens := token_input(model, run.seq)) is None:
        model.metadata_props[ROW_LENGTHS_KEY] = "no token input with a batch axis"
    else:
        past_len = run.rewriter.past_len
        run.rows = RowGather(run.rewriter, tokens, past_len)
        model.graph.insert_after(past_len.producer(), run.rows.nodes)
        if analysis.merged:
            run.rows.refuse(ROWS_REFUSED)


def _position_counts(run: _Run) -> None:
    """Positions counted from the token ids continue from the past length."""
    counts = run.analysis.id_counts
    if counts and run.rows is not None:
        run.rows.refuse(
            f"{layer_name(counts[0])}: positions counted from the token ids "
            "continue from one past length for the whole batch"
        )
    for node in counts:
        continue_count(run.model.graph, node, run.rewriter.past_len)


def _bias_key_values(run: _Run) -> None:
    widen_key_values(run.analysis)


def _junctions(run: _Run) -> None:
    """Token ops reading machinery in a data slot get its last T rows (or, with per-row
    lengths, each row's own rows)."""
    run.junctions = find_junctions(run.analysis, run.junction_keys)
    refuse_rows(run.rows, run.junctions, run.seq)
    rewire_junctions(run.model.graph, run.rewriter, run.rows, run.junctions)


def _cached_token_values(run: _Run) -> None:
    for i, (value, readers) in enumerate(run.analysis.cuts.items()):
        try:
            cache_token_value(run.model, value, readers, run.seq, i)
        except ValueError as exc:
            raise KVCacheError(f"{layer_name(value.producer())}: {exc}") from None


def _bias_reshapes(run: _Run) -> None:
    for node, axis in run.analysis.key_reshapes.items():
        target_tail_from_input(run.model.graph, node, axis)


def _presents(run: _Run) -> None:
    add_presents(run.model, run.analysis, run.pasts)


def _cross_kv_names(run: _Run) -> None:
    name_cross_kv(run.model, run.analysis)


def _encoder_mask(run: _Run) -> None:
    if run.rows is not None:  # slots pad their cross K/V: the step graph masks the padding
        add_encoder_mask(run.model)


def _row_length_record(run: _Run) -> None:
    """Whether the graph takes per-row lengths (model metadata), and where they come from."""
    rows = run.rows
    if rows is None:
        return
    run.model.metadata_props[ROW_LENGTHS_KEY] = rows.refused or PER_ROW
    if not rows.refused:  # for the kernels, should the cleanup remove them
        run.model.graph.metadata_props[ROW_LENGTHS_FROM_KEY] = (
            f"{rows.tokens.name}\n{run.pasts[0].name}"
        )
    if rows.refused:
        logger.info("KV cache without per-row lengths: %s", rows.refused)


def _mask_shapes(run: _Run) -> None:
    widen_masks(run.analysis)


KV_CACHE: tuple[Phase, ...] = (
    ("past inputs", _past_inputs),
    ("past length", _past_length),
    ("row lengths", _row_lengths),
    ("position counts", _position_counts),
    ("bias key values", _bias_key_values),
    ("junctions", _junctions),
    ("cached token values", _cached_token_values),
    ("bias reshapes", _bias_reshapes),
    ("presents", _presents),
    ("cross-attention names", _cross_kv_names),
    ("encoder mask", _encoder_mask),
    ("row-length record", _row_length_record),
    ("mask shapes", _mask_shapes),
)


# -- recurrent layers only -------------------------------------------------------------------


def _states_apply(run: _Run) -> bool:
    """A graph of recurrent layers only takes the mask over past + new where it has a mask and
    a token input to tell the past length by."""
    return bool(run.analysis.masks) and token_input(run.model, run.seq) is not None


def _past_length_from_mask(run: _Run) -> None:
    """No past input to read the length off: the mask's length less the new tokens'."""
    graph = run.model.graph
    tokens = token_input(run.model, run.seq)
    total = ir.node("Shape", [run.analysis.masks[0]], {"start": 1, "end": 2})
    new = ir.node("Shape", [tokens], {"start": 1, "end": 2})
    past = ir.node("Sub", [total.outputs[0], new.outputs[0]])
    graph.insert_before(next(iter(graph)), [total, new, past])
    run.rewriter = Rewriter(run.analysis, past.outputs[0])


def _states_refuse_rows(run: _Run) -> None:
    if run.row_lengths:
        run.model.metadata_props[ROW_LENGTHS_KEY] = STATES_REFUSE_ROWS


STATES_ONLY: tuple[Phase, ...] = (
    ("past length from the mask", _past_length_from_mask),
    ("row lengths", _states_refuse_rows),
    ("position counts", _position_counts),
    ("bias key values", _bias_key_values),
    ("junctions", _junctions),
    ("mask shapes", _mask_shapes),
)


def _run_phases(phases: tuple[Phase, ...], run: _Run) -> None:
    for name, phase in phases:
        logger.debug("InsertKVCachePass: %s", name)
        phase(run)


class InsertKVCachePass(ir.passes.InPlacePass):
    """Give every causal self-attention layer past/present KV (see the module docstring).

    ``modified`` is False for a graph that already has ``past_key_values`` inputs, and for a
    graph of recurrent layers only that has no mask or token input to offset (then it says
    whether the shape phase changed it). Raises :class:`KVCacheError` when a layer cannot be
    cached. The layer checks run first; a few cases (control flow in a mask computation, a
    value without a shape) only show while rewriting, and leave the graph partly rewritten:
    callers abandon it (``export`` writes nothing).
    """

    def __init__(self, row_lengths: bool = False) -> None:
        super().__init__()
        # junctions gathered per row (rows of a batch at different past lengths, in-flight
        # batching) instead of sliced to the last T rows: :mod:`.row_lengths`
        self.row_lengths = row_lengths

    def requires(self, model: ir.Model) -> None:
        lowered = [n for n in model.graph if n.metadata_props.get(LOWERED_FROM_KEY) == "Attention"]
        if lowered:
            raise ir.passes.PreconditionError(
                f"the KV cache goes on canonical tfgraph.Attention, but attention is lowered "
                f"already ({lowered[0].op_type}): run InsertKVCachePass before LowerAttentionPass"
            )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if contract.names_with_role(model, contract.PAST_KEY, contract.PAST_VALUE):
            return ir.passes.PassResult(model, modified=False)  # cached already
        run = _Run(model, self.row_lengths)
        _run_phases(ANALYSIS, run)
        if run.analysis.layers:
            _run_phases(KV_CACHE, run)
            logger.info(
                "KV cache inserted for %d attention layers (%d machinery ops compute only the "
                "new rows)",
                len(run.analysis.layers),
                run.rewriter.slicer.pushed,
            )
        elif _states_apply(run):  # recurrent layers only: the mask still spans past + new
            _run_phases(STATES_ONLY, run)
            logger.info("padding mask over past + new tokens for a recurrent-only graph")
        else:
            return ir.passes.PassResult(model, modified=run.reshaped)
        return ir.passes.PassResult(model, modified=True)
