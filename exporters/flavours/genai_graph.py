"""The genai flavour's graph: each row's past length read off the attention mask, as
onnxruntime-genai feeds it.

onnxruntime-genai's decoder-only model (``past_present_share_buffer``) feeds a decoder
``input_ids``, ``attention_mask`` and, per layer, one preallocated KV buffer bound as both
past and present; it never feeds tfgraph's ``past_sequence_length`` / ``past_sequence_lengths``.
Its conventions (src/models/model.cpp ``PadInputs``, position_inputs.cpp, logits.cpp):

- batched prompts are **right**-padded with ``pad_token_id``; the prompt's mask is 0 on the
  trailing pads, and each row's first token is chosen from its last real position;
- every decoding step appends a column of ones to the mask, so a padded row's mask reads
  ``1 … 1 0 … 0 1``: its sum, not its width, counts the row's positions;
- the row's keys lie compacted in the buffer: GroupQueryAttention (the builder's
  ``seqlens_k = ReduceSum(mask) − 1``) writes a row's new token right after its own tokens,
  over the pads' slots.

:func:`lengths_from_mask` rewrites the graph for that (about fifteen nodes at its top):

- ``past_sequence_lengths`` (each row's) becomes ``max(ReduceSum(mask) − T, 0)``: T new
  tokens after the row's own; 0 on a right-padded prompt (its pads sit after the row's tokens,
  where causal attention never reads them from a real position);
- ``past_sequence_length`` (the common one) becomes ``W − T``, W the mask's width
  (GroupQueryAttention's total sequence length, as the builder computes it);
- every other reader of the mask (the key padding bias, positions derived from the mask) reads
  the **compacted** mask ``arange(W) < ReduceSum(mask)``: the row's positions where its keys
  lie. Without it a padded row's new token is masked as the pad whose slot it took (the
  issue's "a right-padded batch row parts after 2 tokens").

In-flight batching's masks ("a row's own positions", :mod:`tfgraph.runtime.inflight`) are
compacted already and run unchanged; tfgraph's ``generate`` left-pads, and compacts a batch
before each step of such an artifact (:mod:`tfgraph.runtime.generate`). The graph's metadata
says so (``tfgraph.lengths_from`` = ``attention_mask``; ``manifest.json`` ``kv_layout``).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from tfgraph import contract
from tfgraph.passes.rewrite_utils import insert_tape

logger = logging.getLogger(__name__)

# what genai's decoder-only model feeds and reads, by role (anything else it cannot drive)
GENAI_INPUTS = (
    contract.TOKEN_IDS,
    contract.ATTENTION_MASK,
    contract.POSITION_IDS,
    contract.PAST_KEY,
    contract.PAST_VALUE,
)
GENAI_OUTPUTS = (contract.LOGITS, contract.PRESENT_KEY, contract.PRESENT_VALUE)
_LENGTH_ROLES = (contract.PAST_LENGTH, contract.PAST_LENGTHS)


def why_not(model: ir.Model) -> str | None:
    """Why genai cannot drive this cached graph (one clause), or None when it can."""
    signature = contract.signature_of(model)
    roles = {p.role for p in signature.inputs}
    if contract.ENCODER_TOKEN_IDS in roles or roles & {contract.CROSS_KEY, contract.CROSS_VALUE}:
        return "it is an encoder-decoder (genai's decoder-only model has no encoder pass)"
    if roles & set(contract.STATE_ROLES):
        return "its recurrent layers carry a state genai does not feed"
    if contract.PAST_TOKENS in roles:
        return "it caches token values besides keys and values (an indexer's keys)"
    if signature.input(contract.ATTENTION_MASK) is None:
        return "it takes no attention_mask, which genai reads each row's length from"
    if model.metadata_props.get(contract.KV_LAYOUT_KEY) != "shared":
        return (
            "its cache stays copying: an attention layer is not GroupQueryAttention (e.g. a "
            "head size that is not a multiple of 8, or a bias over keys the kernel cannot "
            "take), and genai appends in place to GroupQueryAttention's shared buffer"
        )
    if signature.input(contract.PAST_LENGTHS) is None:
        why = model.metadata_props.get(contract.ROW_LENGTHS_KEY) or "not recorded"
        return f"its rows cannot take their own past lengths ({why}), which genai's padding needs"
    other = sorted(roles - set(GENAI_INPUTS) - set(_LENGTH_ROLES))
    if other:
        return f"it also takes {', '.join(other)}, which genai does not feed"
    outputs = {p.role for p in signature.outputs} - set(GENAI_OUTPUTS)
    if signature.output(contract.LOGITS) is None or outputs:
        return "its outputs are not logits and the presents"
    return None


def _const(tape: ir.tape.Tape, name: str, array: np.ndarray) -> ir.Value:
    value = tape.initializer(ir.tensor(array), name=f"genai_{name}")
    value.shape = ir.Shape(array.shape)
    return value


def lengths_from_mask(model: ir.Model) -> None:
    """Feed the graph's past lengths from ``attention_mask`` and make every other reader of
    the mask read it compacted (module doc); the two length inputs leave the graph."""
    graph = model.graph
    signature = contract.signature_of(model)
    inputs = {v.name: v for v in graph.inputs}
    mask = inputs[signature.input(contract.ATTENTION_MASK).name]
    tokens = inputs[signature.input(contract.TOKEN_IDS).name]
    common = inputs[signature.input(contract.PAST_LENGTH).name]
    rows = inputs[signature.input(contract.PAST_LENGTHS).name]
    readers = [(use.node, use.idx) for use in mask.uses()]
    int64 = ir.DataType.INT64
    tape = ir.tape.Tape()
    counted = mask if mask.dtype == int64 else tape.op("Cast", [mask], {"to": int64})
    axis = _const(tape, "axis1", np.array([1], np.int64))
    total = tape.op("ReduceSum", [counted, axis], {"keepdims": 0}, name="genai_row_total")
    new = tape.op("Shape", [tokens], {"start": 1, "end": 2})
    width = tape.op("Shape", [mask], {"start": 1, "end": 2})
    zero = _const(tape, "zero", np.array(0, np.int64))
    past = tape.op("Sub", [width, new])
    lengths = tape.op("Max", [tape.op("Sub", [total, new]), zero])
    one = _const(tape, "one", np.array(1, np.int64))
    keys = tape.op("Range", [zero, tape.op("Squeeze", [width]), one])
    compact = tape.op(
        "Less",
        [tape.op("Unsqueeze", [keys, _const(tape, "axis0", np.array([0], np.int64))]),
         tape.op("Unsqueeze", [total, axis])],
    )  # fmt: skip
    compact = tape.op("Cast", [compact], {"to": mask.dtype or int64})
    past.name, lengths.name, compact.name = (
        "genai_past_sequence_length", "genai_past_sequence_lengths", "genai_compact_mask",
    )  # fmt: skip
    insert_tape(graph, next(iter(graph)), tape)
    for node, index in readers:
        node.replace_input_with(index, compact)
    common.replace_all_uses_with(past)
    rows.replace_all_uses_with(lengths)
    for value in (common, rows):
        graph.inputs.remove(value)
    contract.drop_roles(model, [common.name, rows.name])
    model.metadata_props[contract.LENGTHS_FROM_KEY] = contract.ATTENTION_MASK
    logger.info(
        "genai: past lengths read off '%s' (%d readers of it take the compacted mask)",
        mask.name,
        len(readers),
    )
