"""The graph side of the ``optimum`` flavour: the step graph's inputs and outputs as Hugging
Face Optimum's ``ORTModelForCausalLM`` and transformers.js feed and read them.

Their decoder contract (what their exporter writes, what their generation loops feed):

- inputs ``input_ids`` (batch, sequence) int64, ``attention_mask`` (batch, past + sequence)
  int64, then ``past_key_values.{i}.key`` / ``.value`` (batch, kv_heads, past, head_size) for
  i = 0, 1, … in that order (Optimum zips its pasts with the inputs in graph order; both
  start from an empty past of 0 positions);
- outputs ``logits`` then ``present.{i}.key`` / ``.value`` (past + sequence positions: the
  ``concat`` KV layout the flavour asks the pipeline for), in the same order (Optimum pairs
  them two by two into layers);
- the batch dim named ``batch_size``: transformers.js sizes its empty past from the graph's
  input shapes and resolves only that symbol (any other symbolic dim becomes 0).

``position_ids``: both clients feed it only where the graph takes it, as ``cumsum(mask) - 1``
with pads at 1; a Hugging Face causal LM traced by tfgraph derives exactly these positions from
``attention_mask`` inside the graph (``_HFCausalLM``), so it takes none and nothing is lost (a
graph that does take one keeps it, named ``position_ids``). The attention stays fused
(GroupQueryAttention / MultiHeadAttention): only names, order and dim names change.
"""

from __future__ import annotations

import onnx_ir as ir

from tfgraph import contract
from tfgraph.errors import TfgraphError

BATCH_DIM = "batch_size"  # the symbol transformers.js resolves to the batch
TRACED_BATCH_DIMS = ("batch",)
# roles and the names Optimum gives them (a layer's number goes into the braces)
OPTIMUM_NAMES = {
    contract.TOKEN_IDS: "input_ids",
    contract.ATTENTION_MASK: "attention_mask",
    contract.POSITION_IDS: "position_ids",  # fed by both clients as cumsum(mask) - 1
    contract.LOGITS: "logits",
    contract.PAST_KEY: "past_key_values.{}.key",
    contract.PAST_VALUE: "past_key_values.{}.value",
    contract.PRESENT_KEY: "present.{}.key",
    contract.PRESENT_VALUE: "present.{}.value",
}
# an encoder-decoder's pair is written from the saved files (optimum_seq2seq.py); these roles
# reach this check only from a model whose config.json does not say it is one
_SEQ2SEQ = "encoder inputs while its config.json does not say is_encoder_decoder"
_SHARED = "a shared KV buffer with explicit past lengths"
_WHY = {
    contract.CROSS_KEY: _SEQ2SEQ,
    contract.CROSS_VALUE: _SEQ2SEQ,
    contract.ENCODER_TOKEN_IDS: _SEQ2SEQ,
    contract.ENCODER_ATTENTION_MASK: _SEQ2SEQ,
    contract.ENCODER_SLOT_MASK: _SEQ2SEQ,
    contract.PAST_TOKENS: "per-token indexer values in its cache (DeepSeek's sparse attention)",
    contract.PAST_LENGTH: _SHARED,
    contract.PAST_LENGTHS: _SHARED,
    contract.INPUT: "an input the clients do not feed",
    **dict.fromkeys(
        contract.STATE_ROLES, "recurrent layers' states (the clients carry past_key_values only)"
    ),
}


def check_contract(signature: contract.Signature) -> None:
    """Refuse, in one line, a graph whose inputs Optimum and transformers.js cannot feed."""
    for port in signature.inputs:
        why = _WHY.get(port.role)
        if why:
            raise TfgraphError(
                f"--flavour optimum cannot lay out input '{port.name}' ({port.role}): the "
                f"model has {why}; export it with --flavour tfgraph"
            )
    if signature.input(contract.TOKEN_IDS) is None:
        raise TfgraphError("--flavour optimum lays out token models: this graph takes no token ids")
    if signature.output(contract.LOGITS) is None:
        raise TfgraphError("--flavour optimum needs a causal LM: this graph has no logits output")
    layers = signature.cache_layers
    if not layers:
        raise TfgraphError("--flavour optimum needs --kv-cache (the clients feed past_key_values)")
    if layers != list(range(len(layers))):
        raise TfgraphError(
            f"--flavour optimum needs a KV cache in every layer 0..{len(layers) - 1}; the graph "
            f"caches layers {layers} (hybrid layer stacks are not laid out)"
        )


_SINGLE_INPUTS = (contract.TOKEN_IDS, contract.ATTENTION_MASK, contract.POSITION_IDS)


def _ordered(values, roles, sequence) -> list:
    """``values`` in Optimum's order: the named singles, then the cache by layer, key first."""

    def rank(value):
        role, layer = roles.get(value.name, (contract.INPUT, None))
        if role in sequence:
            return (sequence.index(role), 0, 0)
        kv = (contract.PAST_KEY, contract.PRESENT_KEY)
        return (len(sequence), layer or 0, 0 if role in kv else 1)

    return sorted(values, key=rank)


def _renamed_dims(value: ir.Value) -> bool:
    shape = value.shape
    if shape is None or not any(
        isinstance(d, ir.SymbolicDim) and d.value in TRACED_BATCH_DIMS for d in shape
    ):
        return False
    value.shape = ir.Shape(
        [
            ir.SymbolicDim(BATCH_DIM)
            if isinstance(d, ir.SymbolicDim) and d.value in TRACED_BATCH_DIMS
            else d
            for d in shape
        ]
    )
    return True


def lay_out_io(model: ir.Model) -> bool:
    """Names, order and batch dim of ``model``'s inputs and outputs as Optimum's contract
    (module docstring), roles kept; whether anything changed."""
    graph = model.graph
    check_contract(contract.signature_of(model))
    roles = contract.read_roles(model.metadata_props)
    changed = False
    renamed = {}
    for value in [*graph.inputs, *graph.outputs]:
        role, layer = roles.get(value.name, (None, None))
        pattern = OPTIMUM_NAMES.get(role)
        if pattern is None:
            continue
        name = pattern.format(layer)
        if value.name != name:
            renamed[value.name], value.name = name, name
    if renamed:
        roles = {renamed.get(n, n): r for n, r in roles.items()}
        contract.write_roles(model, roles)
        changed = True
    inputs = _ordered(list(graph.inputs), roles, _SINGLE_INPUTS)
    outputs = _ordered(list(graph.outputs), roles, (contract.LOGITS,))
    if inputs != list(graph.inputs) or outputs != list(graph.outputs):
        graph.inputs[:], graph.outputs[:] = inputs, outputs
        changed = True
    return rename_batch_dims(model) or changed


def rename_batch_dims(model: ir.Model) -> bool:
    """The traced batch dim named ``batch_size`` wherever a value's shape states it."""
    changed = False
    for value in [*model.graph.inputs, *model.graph.outputs]:
        changed = _renamed_dims(value) or changed
    for node in model.graph:
        for value in node.outputs:
            changed = _renamed_dims(value) or changed
    return changed
