"""The artifact contract: the role of every graph input and output, their names, the KV layout.

This module is the one place that spells the names the exporter gives to the tensors it adds
(``past_key_values.{i}.key``, ``past_sequence_length``, ``cross_key_values.{i}.key`` …) and the
one place that says what each input and output *is*. Everything else asks by role:

=========================== ====== ===================================================
role                        layer  meaning
=========================== ====== ===================================================
``token_ids``                      the tokens the model reads (decoder side of a seq2seq)
``attention_mask``                 padding mask over the token positions (past + new)
``position_ids``                   explicit positions of the tokens
``encoder_token_ids``              token ids of a seq2seq encoder
``encoder_attention_mask``         padding mask over the encoder positions
``encoder_slot_mask``              the cross K/V positions a slot holds, 1 for the request's own:
                                   added at export where the model takes no encoder mask (ones
                                   outside in-flight batching: the model as written)
``input``                          any other data input the user feeds
``past_key`` / ``past_value``  i   the cache of self-attention layer i
``past_length``                    positions already in a shared cache buffer (the longest row's)
``past_lengths``                   each row's own past length, (batch,): in-flight batching
``cross_key`` / ``cross_value`` i  the encoder's keys/values for decoder layer i
``logits``                         next-token scores
``hidden_states``                  the last hidden state (encoders)
``present_key`` / ``present_value`` i  layer i's cache after this step
``past_conv_state``            i   the carry of causal convolution i (B, C, K − 1)
``past_recurrent_state``       i   the state of linear-attention recurrence i (B, H, d_k, d_v)
``present_conv_state`` /       i   those states after this step (fixed size: the next step
``present_recurrent_state``        feeds them back as they are)
``output``                         any other output
=========================== ====== ===================================================

Roles travel in the model itself (metadata ``tfgraph.roles``, JSON ``{name: [role, layer]}``)
from the trace on: each step that adds an input or output states its role there, and
``manifest.json`` lists them (:func:`signature_of`). A runner, a server or a user drives an
artifact from its :class:`Signature` alone.

The KV layout (``manifest.json`` ``kv_layout``): ``concat`` (each present output is the past
followed by the new positions: a fresh tensor per step) or ``shared`` (each past input is a
preallocated buffer of ``capacity_dim`` positions; the present output aliases it, written in
place; ``past_length`` says how many positions are filled).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx_ir as ir

ROLES_KEY = "tfgraph.roles"  # model metadata: {name: [role, layer or null]}
# preallocated buffers that past and present share: "shared" (GroupQueryAttention appends in
# place), "static" (standard TensorScatter-24 writes in place); else the copying "concat"
BUFFER_LAYOUTS = ("shared", "static")
KV_LAYOUT_KEY = "tfgraph.kv_buffer"  # model metadata: "shared" for a preallocated buffer
KV_QUANT_KEY = "tfgraph.kv_quantization"  # model metadata: an int8 cache's dtype and scales

TOKEN_IDS = "token_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
ENCODER_TOKEN_IDS = "encoder_token_ids"
ENCODER_ATTENTION_MASK = "encoder_attention_mask"
ENCODER_SLOT_MASK = "encoder_slot_mask"  # passes/encoder_mask.py
INPUT = "input"
PAST_KEY, PAST_VALUE = "past_key", "past_value"
PAST_LENGTH = "past_length"
# per-row past lengths (batch,): rows of one batch at different lengths in one buffer
# (in-flight batching); ``past_length`` is then the longest row's
PAST_LENGTHS = "past_lengths"
CROSS_KEY, CROSS_VALUE = "cross_key", "cross_value"
LOGITS = "logits"
HIDDEN_STATES = "hidden_states"
PRESENT_KEY, PRESENT_VALUE = "present_key", "present_value"
OUTPUT = "output"
# vision-language artifacts (tfgraph/sources/vision_language.py): the processor's images, and
# the vision graph's features that the decoder merges at the image-token positions
PIXEL_VALUES, IMAGE_FEATURES = "pixel_values", "image_features"
# M-RoPE decoders (Qwen2-VL): each row's position offset after its image block, every step
ROPE_DELTAS = "rope_deltas"
# Mllama's decoder: each row's real image tiles (the processor's aspect_ratio_mask), every step
IMAGE_TILES = "image_tiles"
# PaliGemma's decoder: each row's prompt end in the step's columns (its prompt attends
# bidirectionally), fed at every step (tfgraph/sources/vlm_families/gemma.py)
PROMPT_LENGTH = "prompt_length"
# per-prompt inputs besides the tokens
PROMPT_ROLES = (IMAGE_FEATURES, ROPE_DELTAS, IMAGE_TILES, PROMPT_LENGTH)

# recurrent layers' carried state (passes/insert_recurrent_state.py): numbered apart from the
# attention layers, in graph order; zeros before the first step, then the presents
PAST_CONV_STATE, PRESENT_CONV_STATE = "past_conv_state", "present_conv_state"
PAST_RECURRENT_STATE, PRESENT_RECURRENT_STATE = "past_recurrent_state", "present_recurrent_state"
STATE_PRESENT_OF = {
    PAST_CONV_STATE: PRESENT_CONV_STATE,
    PAST_RECURRENT_STATE: PRESENT_RECURRENT_STATE,
}
STATE_ROLES = tuple(STATE_PRESENT_OF)

# per-token values that a bias computed from the tokens reads along the key axis (DSA's
# indexer keys): (batch, 1, past_sequence, width), grown like K (passes/insert_kv_cache.py);
# numbered apart from the attention layers, in graph order
PAST_TOKENS, PRESENT_TOKENS = "past_token_values", "present_token_values"

GENERIC_ROLES = frozenset({INPUT, OUTPUT})
PRESENT_OF = {PAST_KEY: PRESENT_KEY, PAST_VALUE: PRESENT_VALUE}
GROWING_PRESENT_OF = {**PRESENT_OF, PAST_TOKENS: PRESENT_TOKENS}  # past + new along the sequence

# Names the exporter gives to the tensors it adds (the roles above say what they are).
_NAMES = {
    PAST_KEY: "past_key_values.{}.key",
    PAST_VALUE: "past_key_values.{}.value",
    PRESENT_KEY: "present.{}.key",
    PRESENT_VALUE: "present.{}.value",
    CROSS_KEY: "cross_key_values.{}.key",
    CROSS_VALUE: "cross_key_values.{}.value",
    PAST_CONV_STATE: "past_conv_state.{}",
    PRESENT_CONV_STATE: "present_conv_state.{}",
    PAST_RECURRENT_STATE: "past_recurrent_state.{}",
    PRESENT_RECURRENT_STATE: "present_recurrent_state.{}",
    PAST_TOKENS: "past_token_values.{}",
    PRESENT_TOKENS: "present_token_values.{}",
}
PAST_LENGTH_NAME = "past_sequence_length"
PAST_LENGTHS_NAME = "past_sequence_lengths"

# Symbolic dims of the cache tensors.
PAST_DIM, TOTAL_DIM, BUFFER_DIM = "past_sequence", "total_sequence", "max_sequence"
# Named dims that count token positions (checked against ``max_positions``).
SEQUENCE_DIMS = frozenset({"sequence", "decoder_sequence", TOTAL_DIM})

# Paged KV cache (opt-in on ort-cuda, passes/paged_attention.py): per layer a pool of blocks of
# ``block_size`` positions, (num_blocks, block_size, kv_heads, head_size), shared by every row and
# found through each row's block table; the output of the same role and layer aliases the input
KEY_BLOCKS, VALUE_BLOCKS = "key_blocks", "value_blocks"
BLOCK_TABLE = "block_table"  # (batch, max_blocks_per_sequence) int32: each row's blocks, in order
KV_PAGED_KEY = "tfgraph.kv_paged"  # model metadata: the paged layout (JSON), for the manifest
BLOCK_NAMES = {KEY_BLOCKS: "key_blocks.{}", VALUE_BLOCKS: "value_blocks.{}"}
PRESENT_BLOCK_NAMES = {
    KEY_BLOCKS: "present.{}.key_blocks",
    VALUE_BLOCKS: "present.{}.value_blocks",
}
BLOCK_TABLE_NAME = "block_table"
BLOCKS_DIM, TABLE_DIM = "num_blocks", "max_blocks_per_sequence"

ENCODER_FILE = "encoder.onnx"  # encoder-decoder artifacts: cross-attention K/V, run once
MODEL_FILE = "model.onnx"


def tensor_name(role: str, layer: int) -> str:
    """The name the exporter gives the tensor of ``role`` for ``layer``."""
    return _NAMES[role].format(layer)


@dataclass(frozen=True)
class Port:
    """One input or output: its role (and layer) and the graph's name for it."""

    name: str
    role: str
    layer: int | None = None
    dtype: str | None = None
    shape: list | None = None

    @property
    def key(self) -> tuple[str, int | str | None]:
        """``(role, layer)``; ports of the generic roles (``input``, ``output``) are told
        apart by name: ``(role, name)``."""
        if self.role in GENERIC_ROLES:
            return (self.role, self.name)
        return (self.role, self.layer)

    def as_dict(self) -> dict:
        out = {"name": self.name, "dtype": self.dtype, "shape": self.shape, "role": self.role}
        if self.layer is not None:
            out["layer"] = self.layer
        return out

    @classmethod
    def from_dict(cls, entry: Mapping) -> Port:
        return cls(
            entry["name"],
            entry.get("role", INPUT),
            entry.get("layer"),
            entry.get("dtype"),
            entry.get("shape"),
        )


@dataclass(frozen=True)
class Signature:
    """The inputs and outputs of one graph, by role; ``kv_layout`` as in the module docstring
    (``None`` without a cache)."""

    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    kv_layout: dict | None = None
    _index: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for side, ports in (("in", self.inputs), ("out", self.outputs)):
            for port in ports:
                self._index.setdefault((side, port.key), port)

    def input(self, role: str, layer: int | None = None) -> Port | None:
        return self._index.get(("in", (role, layer)))

    def output(self, role: str, layer: int | None = None) -> Port | None:
        return self._index.get(("out", (role, layer)))

    def inputs_with(self, *roles: str) -> list[Port]:
        return [p for p in self.inputs if p.role in roles]

    @property
    def cache_layers(self) -> list[int]:
        return sorted({p.layer for p in self.inputs if p.role in (PAST_KEY, PAST_VALUE)})

    @property
    def state_inputs(self) -> list[Port]:
        """The recurrent layers' carried states (zeros before the first step)."""
        return self.inputs_with(*STATE_ROLES)

    @property
    def cached(self) -> bool:
        """The graph carries something across steps: a KV cache or recurrent states."""
        return bool(self.cache_layers or self.state_inputs)

    @property
    def shared_buffer(self) -> bool:
        return bool(self.kv_layout) and self.kv_layout.get("kind") in BUFFER_LAYOUTS

    @property
    def row_lengths(self) -> bool:
        """Rows of a batch may hold different past lengths (``past_lengths`` input, or the
        attention mask's row sums: :attr:`lengths_from_mask`): the graph serves in-flight
        batching."""
        return self.shared_buffer and (
            self.input(PAST_LENGTHS) is not None or self.lengths_from_mask
        )

    @property
    def lengths_from_mask(self) -> bool:
        """The graph reads each row's past length off ``attention_mask`` (its sum less the
        new tokens, the row's keys compacted: onnxruntime-genai's convention, the ``genai``
        flavour) instead of taking ``past_length`` / ``past_lengths`` inputs."""
        return bool(self.kv_layout) and self.kv_layout.get("lengths_from") == ATTENTION_MASK

    def as_dict(self) -> dict:
        return {
            "inputs": [p.as_dict() for p in self.inputs],
            "outputs": [p.as_dict() for p in self.outputs],
        }

    @classmethod
    def from_dict(cls, entry: Mapping, kv_layout: dict | None = None) -> Signature:
        return cls(
            tuple(Port.from_dict(p) for p in entry["inputs"]),
            tuple(Port.from_dict(p) for p in entry["outputs"]),
            kv_layout,
        )


# --- roles in the model's metadata ------------------------------------------------------------


def read_roles(metadata: Mapping[str, str]) -> dict[str, tuple[str, int | None]]:
    """``{name: (role, layer)}`` from a model's metadata (``{}`` when it states none)."""
    raw = metadata.get(ROLES_KEY)
    if not raw:
        return {}
    return {name: (entry[0], entry[1]) for name, entry in json.loads(raw).items()}


def write_roles(model: ir.Model, roles: Mapping[str, tuple[str, int | None]]) -> None:
    model.metadata_props[ROLES_KEY] = json.dumps(
        {name: [role, layer] for name, (role, layer) in roles.items()}, sort_keys=True
    )


def set_role(model: ir.Model, name: str, role: str, layer: int | None = None) -> None:
    """State the role of graph input or output ``name``."""
    roles = read_roles(model.metadata_props)
    roles[name] = (role, layer)
    write_roles(model, roles)


def drop_roles(model: ir.Model, names: Iterable[str]) -> None:
    roles = read_roles(model.metadata_props)
    for name in names:
        roles.pop(name, None)
    write_roles(model, roles)


def names_with_role(model: ir.Model, *roles: str) -> list[str]:
    """Graph inputs and outputs of ``model`` that have one of ``roles``, in graph order (roles
    inferred for a graph that states none)."""
    signature = signature_of(model)
    return [p.name for p in (*signature.inputs, *signature.outputs) if p.role in roles]


def infer_input_roles(names: Iterable[str], dtypes: Mapping[str, str] | None = None) -> dict:
    """Roles for a source's inputs when the model does not state them (``input_roles``): the
    Hugging Face names, then the first integer input as the tokens. The one place that reads
    meaning into an input's name; every later step reads the roles it wrote."""
    names = list(names)
    dtypes = dtypes or {}
    seq2seq = "decoder_input_ids" in names
    known = {
        "input_ids": ENCODER_TOKEN_IDS if seq2seq else TOKEN_IDS,
        "decoder_input_ids": TOKEN_IDS,
        "attention_mask": ENCODER_ATTENTION_MASK if seq2seq else ATTENTION_MASK,
        "decoder_attention_mask": ATTENTION_MASK,
        "position_ids": POSITION_IDS,
        "decoder_position_ids": POSITION_IDS,
    }
    roles: dict[str, tuple[str, None]] = {}
    for name in names:
        role = known.get(name)
        if role is None and "mask" in name.lower():
            role = ENCODER_ATTENTION_MASK if seq2seq else ATTENTION_MASK
        roles[name] = (role or INPUT, None)
    if not any(r == TOKEN_IDS for r, _ in roles.values()):
        ints = [n for n in names if roles[n][0] == INPUT and "int" in dtypes.get(n, "int")]
        if ints:
            roles[ints[0]] = (TOKEN_IDS, None)
    return roles


def infer_output_roles(names: Iterable[str]) -> dict:
    known = {"logits": LOGITS, "last_hidden_state": HIDDEN_STATES}
    return {name: (known.get(name, OUTPUT), None) for name in names}


# --- signatures -----------------------------------------------------------------------------


def describe_value(value: ir.Value) -> dict:
    """Name, dtype and symbolic shape (named dims as strings, static ones as ints)."""
    dtype = value.dtype.name.lower() if value.dtype is not None else None
    shape = None
    if value.shape is not None:
        shape = [d if isinstance(d, int) else str(d.value) for d in value.shape]
    return {"name": value.name, "dtype": dtype, "shape": shape}


def kv_layout(metadata: Mapping[str, str], input_names: Iterable[str]) -> dict | None:
    """The KV layout a graph's metadata states for its past inputs (``None`` without a cache)."""
    roles = read_roles(metadata)
    names = set(input_names)
    if metadata.get(KV_LAYOUT_KEY) == "paged" and KV_PAGED_KEY in metadata:
        return json.loads(metadata[KV_PAGED_KEY])  # blocks and a block table (PagedAttention)
    pasts = [n for n, (r, _) in roles.items() if r in GROWING_PRESENT_OF and n in names]
    if not pasts:
        return None
    present = {(r, layer): n for n, (r, layer) in roles.items() if r in GROWING_PRESENT_OF.values()}
    kind = metadata.get(KV_LAYOUT_KEY)
    shared = kind in BUFFER_LAYOUTS
    aliases = {}
    for name in pasts:
        role, layer = roles[name]
        out = present.get((GROWING_PRESENT_OF[role], layer))
        if out is not None:
            aliases[out] = name
    return {
        "kind": kind if shared else "concat",
        "capacity_dim": BUFFER_DIM if shared else None,
        "layers": len({roles[n][1] for n in pasts if roles[n][0] in PRESENT_OF}),
        "present_aliases_past": aliases if shared else {},
        "present_extends_past": {} if shared else aliases,
        # the input that gives each row its own past length (in-flight batching), if any
        "row_lengths": next(
            (n for n, (r, _) in roles.items() if r == PAST_LENGTHS and n in names), None
        ),
        # why the graph takes no per-row lengths, when the KV-cache pass said
        **({"row_lengths_refused": why} if (why := _row_lengths_refused(metadata)) else {}),
        # past lengths read off the attention mask (Signature.lengths_from_mask)
        **({"lengths_from": ATTENTION_MASK} if metadata.get(LENGTHS_FROM_KEY) else {}),
    }


ROW_LENGTHS_KEY = "tfgraph.row_lengths"  # model metadata: "per_row", or why not
# model metadata: "attention_mask" where the past lengths are read off the mask (the genai
# flavour, tfgraph/exporters/flavours/genai_graph.py)
LENGTHS_FROM_KEY = "tfgraph.lengths_from"


def _row_lengths_refused(metadata: Mapping[str, str]) -> str | None:
    why = metadata.get(ROW_LENGTHS_KEY)
    return why if why and why != "per_row" else None


def build_signature(
    inputs: Sequence[tuple[str, str | None, list | None]],
    outputs: Sequence[tuple[str, str | None, list | None]],
    metadata: Mapping[str, str],
) -> Signature:
    """A signature from ``(name, dtype, shape)`` triples and the graph's metadata: the roles it
    states, else (a graph not written by tfgraph) the inferred ones."""
    stated = read_roles(metadata)
    if not stated:
        stated = {
            **infer_input_roles([n for n, _, _ in inputs], {n: str(d) for n, d, _ in inputs}),
            **infer_output_roles([n for n, _, _ in outputs]),
        }

    def ports(values, default: str) -> tuple[Port, ...]:
        return tuple(
            Port(name, *stated.get(name, (default, None)), dtype, shape)
            for name, dtype, shape in values
        )

    layout = kv_layout(metadata, [n for n, _, _ in inputs])
    return Signature(ports(inputs, INPUT), ports(outputs, OUTPUT), layout)


def signature_of(model: ir.Model) -> Signature:
    """The signature of an ``onnx_ir`` model (roles from its metadata)."""

    def triples(values):
        return [(d["name"], d["dtype"], d["shape"]) for d in map(describe_value, values)]

    return build_signature(
        triples(model.graph.inputs), triples(model.graph.outputs), model.metadata_props
    )


def signature_from_manifest(manifest: Mapping, file: str = MODEL_FILE) -> Signature | None:
    """The signature ``manifest.json`` states for ``file`` (``None`` if it states none)."""
    graphs = manifest.get("graphs") or {}
    entry = graphs.get(file)
    if entry is None:
        return None
    return Signature.from_dict(entry, entry.get("kv_layout"))
