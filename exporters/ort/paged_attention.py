"""``ort-cuda``, opt-in: the shared KV buffer becomes ONNX Runtime's paged KV cache.

What is lowered. Each cached ``GroupQueryAttention`` of a graph whose buffers past and present
share (:mod:`.share_kv_buffer`) and whose rows take their own past lengths (input
``past_sequence_lengths``, :mod:`.row_lengths`) becomes ``com.microsoft.PagedAttention``
(ONNX Runtime 1.32 schema, read from the installed package): the keys and values of every row
live in one pool of blocks per layer, ``(num_blocks, block_size, kv_num_heads, head_size)``,
found through a block table, ``(batch, max_blocks_per_sequence)`` int32, as vLLM's scheduler
hands out blocks per request. Tokens stay ``(batch, T)`` at the graph boundary: every row reads
T new tokens, so the packed ``(batch·T, hidden)`` tokens PagedAttention takes are a ``Flatten``
inside the graph, and its ``cumulative_sequence_length`` is ``0, T, 2T … batch·T``, computed in
the graph (an input could only disagree with the token shape). Rows with different numbers of
new tokens in one step would need packed tokens at the boundary: not built.

What is verified here (no GPU, and PagedAttention has no CPU kernel in 1.32): the graph is
well-formed. ONNX's checker passes, and ONNX Runtime's CPU session creation gets past graph
resolution and type inference and stops at kernel assignment with "Could not find an
implementation for PagedAttention(1) node" (a type error would stop it earlier, with
INVALID_GRAPH). The mapping between the two layouts (block table + cumulative lengths against
GroupQueryAttention's ``seqlens_k`` over a contiguous buffer) is checked numerically against a
numpy reading of the schema (tests/exporters/ort/test_paged_attention.py).

What is not verified until a GPU is lent: the CUDA kernel's numerics against that reading, its
speed, and whether writing into a cache bound both as input and as the aliasing output (I/O
binding, as with the shared buffer) is what the kernel expects.

Schema facts the rewrite rests on (ONNX Runtime 1.32): query/key/value are 2-D packed tokens of
type float16 or bfloat16 only (no float32: an fp32 graph is refused, export with
``precision="fp16"``); ``cumulative_sequence_length`` (batch + 1), ``past_seqlens`` (batch) and
``block_table`` are int32; ``key_cache_out`` / ``value_cache_out`` alias the caches, which the op
updates in place; ``is_causal`` defaults to 1, bottom-right aligned; there is no
``attention_bias`` input. ONNX Runtime's CUDA source further requires a head size that is a
multiple of 8 and a block size that is a power of two of at least 16 (checked here).
"""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common

from tfgraph import contract
from tfgraph.passes.canonical import require_lowered_attention
from tfgraph.passes.provenance import module_name
from tfgraph.passes.rewrite_utils import add_initializer, insert_tape, replace_value

logger = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"
PAGED = "paged"
PAGED_DTYPES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)  # PagedAttention's type T
# GroupQueryAttention input → PagedAttention input, for the inputs passed through unchanged
# (query, key, value, cos_cache, sin_cache, head_sink); 3-6 (past, seqlens_k, total length) are
# rebuilt; any other GQA input refuses the graph
PASSED_INPUTS = {0: 0, 1: 1, 2: 2, 7: 8, 8: 9, 11: 11}
REBUILT_INPUTS = {3, 4, 5, 6}
PAGED_INPUT_COUNT = 12  # … slot_mapping (10, not used: slots follow from the lengths), head_sink
# GroupQueryAttention attributes with the same meaning on PagedAttention
PASSED_ATTRIBUTES = (
    "num_heads",
    "kv_num_heads",
    "scale",
    "softcap",
    "local_window_size",
    "do_rotary",
    "rotary_interleaved",
)
GQA_INPUT_NAMES = {9: "position_ids", 10: "attention_bias", 12: "k_scale", 13: "v_scale"}


def valid_block_size(block_size: int) -> bool:
    """ONNX Runtime's CUDA check: a power of two of at least 16."""
    return block_size >= 16 and block_size & (block_size - 1) == 0


def _is_cached_gqa(node: ir.Node, pasts: dict) -> bool:
    return (
        node.domain == MS_DOMAIN
        and node.op_type == "GroupQueryAttention"
        and len(node.inputs) > 4
        and node.inputs[3] is not None
        and node.inputs[3].name in pasts
    )


def why_not_node(node: ir.Node, pasts: dict) -> str | None:
    """Why this cached GroupQueryAttention has no PagedAttention form; None when it has."""
    where = f"layer {module_name(node) or node.name}"
    extra = [i for i, v in enumerate(node.inputs) if v is not None and i > 4]
    extra = [i for i in extra if i not in PASSED_INPUTS and i not in REBUILT_INPUTS]
    if extra:
        names = [GQA_INPUT_NAMES.get(i, f"input {i}") for i in extra]
        return f"{where}: GroupQueryAttention's {', '.join(names)} has no PagedAttention input"
    allowed = {*PASSED_ATTRIBUTES, "causal"}
    unknown = sorted(set(node.attributes) - allowed)
    if unknown:
        return f"{where}: attribute {', '.join(unknown)} is not mapped to PagedAttention"
    if node.attributes.get_int("causal", 0) != 1:
        return f"{where}: not causal (PagedAttention is causal here)"
    value = node.inputs[4]
    if value is None or value.name not in pasts or pasts[value.name][0] != contract.PAST_VALUE:
        return f"{where}: its past_value is not a past_value input"
    query = node.inputs[0]
    if query.dtype not in PAGED_DTYPES:
        dtype = query.dtype.name if query.dtype is not None else "unknown"
        return (
            f"{where}: PagedAttention takes float16 or bfloat16, the query is {dtype} "
            "(export with precision fp16)"
        )
    if query.shape is None or len(query.shape) != 3:
        return f"{where}: the query is not (batch, T, hidden)"
    past = node.inputs[3]
    if (
        past.shape is None
        or len(past.shape) != 4
        or not all(isinstance(d, int) for d in (past.shape[1], past.shape[3]))
    ):
        return f"{where}: the past key is not (batch, kv_heads, positions, head_size)"
    if past.shape[3] % 8:
        return f"{where}: head size {past.shape[3]} is not a multiple of 8"
    return None


def why_not_graph(model: ir.Model, nodes: list[ir.Node], pasts: dict) -> str | None:
    """Why this graph cannot take the paged cache (all layers or none); None when it can."""
    layout = model.metadata_props.get(contract.KV_LAYOUT_KEY)
    if layout != "shared":
        return f"the KV cache is not a buffer past and present share (layout {layout})"
    if not contract.names_with_role(model, contract.PAST_LENGTHS):
        why = model.metadata_props.get(contract.ROW_LENGTHS_KEY) or "no past_lengths input"
        return f"the rows do not take their own past lengths ({why})"
    if not nodes:
        return "no cached GroupQueryAttention"
    read = {v.name for n in nodes for v in n.inputs[3:5]}
    unread = sorted(set(pasts) - read)
    if unread:
        return f"past inputs not read by a cached GroupQueryAttention: {', '.join(unread)}"
    for node in nodes:
        for past in node.inputs[3:5]:
            others = [u.node for u in past.uses() if u.node is not node or u.idx not in (3, 4)]
            if others:
                return f"{past.name} is also read by {others[0].op_type}"
    return next((why for n in nodes if (why := why_not_node(n, pasts))), None)


class PagedAttentionPass(ir.passes.InPlacePass):
    """Rewrite the shared-buffer KV cache into ONNX Runtime's paged one (module docstring).

    1. For every node ``y, present_k, present_v = GroupQueryAttention(q, k, v, past_k, past_v,
       seqlens_k, total, [cos, sin, -, -, sink])`` whose pasts are the inputs of layer i::

           q ─ Flatten(2) ─┐ (B·T, Hq·d)          key_blocks.i ───┐ (num_blocks, block, Hkv, d)
           k ─ Flatten(2) ─┤                      value_blocks.i ─┤
           v ─ Flatten(2) ─┤   cumulative (B+1) ──────────────────┤ 0, T, … B·T (int32)
                           │   past_sequence_lengths ─ Cast ──────┤ (B,) int32
                           │   block_table ───────────────────────┤ (B, max_blocks) int32
                           └──────────────────────► PagedAttention ─► Reshape (B, T, Hq·d) ─► y
                                                     └► present.i.key_blocks, …value_blocks

       with ``num_heads``, ``kv_num_heads``, ``scale``, ``softcap``, ``local_window_size`` and
       the rotary attributes and caches passed through.
    2. The past inputs and present outputs of every layer give way to the block pools (roles
       ``key_blocks`` / ``value_blocks``, layer i, on both sides: the output aliases the input)
       and ``block_table`` (role ``block_table``) is added; ``past_sequence_length`` goes when
       nothing reads it any more.
    3. The layout is recorded: metadata ``tfgraph.kv_buffer = paged`` and ``tfgraph.kv_paged``
       (block size, dims, aliases) for the manifest.

    All layers or none: when one cannot be rewritten, the graph is left as it is
    (``modified=False``) and ``refused`` says which layer and why. A paged graph is left alone.
    """

    def __init__(self, block_size: int = 16) -> None:
        super().__init__()
        if not valid_block_size(block_size):
            raise ValueError(f"block size {block_size} is not a power of two >= 16")
        self.block_size = block_size
        self.refused: str | None = None

    def requires(self, model: ir.Model) -> None:
        require_lowered_attention(
            model, self, "the paged KV cache (GroupQueryAttention)",
            "LowerAttentionPass and ShareKVBufferPass",
        )  # fmt: skip

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.refused = None
        if model.metadata_props.get(contract.KV_LAYOUT_KEY) == PAGED:
            return ir.passes.PassResult(model, modified=False)
        roles = contract.read_roles(model.metadata_props)
        names = contract.names_with_role(model, contract.PAST_KEY, contract.PAST_VALUE)
        pasts = {v.name: roles[v.name] for v in model.graph.inputs if v.name in names}
        nodes = [n for n in model.graph if _is_cached_gqa(n, pasts)]
        self.refused = why_not_graph(model, nodes, pasts)
        if self.refused is not None:
            logger.info("KV cache stays a shared buffer: %s", self.refused)
            return ir.passes.PassResult(model, modified=False)
        _Paging(model, self.block_size, pasts).rewrite(nodes)
        logger.info("KV cache: %d layers paged (block size %d)", len(nodes), self.block_size)
        return ir.passes.PassResult(model, modified=True)


class _Paging:
    """The rewrite of one graph: the inputs every layer shares, then each layer."""

    def __init__(self, model: ir.Model, block_size: int, pasts: dict) -> None:
        self.model, self.graph = model, model.graph
        self.block_size = block_size
        self.pasts = pasts
        self.lengths = next(
            v
            for v in self.graph.inputs
            if v.name in contract.names_with_role(model, contract.PAST_LENGTHS)
        )
        batch = self.lengths.shape[0] if self.lengths.shape is not None else "batch"
        self.table = ir.Value(
            name=contract.BLOCK_TABLE_NAME,
            type=ir.TensorType(ir.DataType.INT32),
            shape=ir.Shape([batch, contract.TABLE_DIM]),
        )
        self.aliases: dict[str, str] = {}
        self.consts: dict[str, ir.Value] = {}

    def rewrite(self, nodes: list[ir.Node]) -> None:
        graph = self.graph
        graph.inputs.append(self.table)
        contract.set_role(self.model, self.table.name, contract.BLOCK_TABLE)
        self.cumulative, self.past_seqlens = self.shared(nodes[0])
        for node in nodes:
            self.layer(node)
        common.RemoveUnusedNodesPass()(self.model)  # GQA's seqlens_k and total length
        self.drop_unread_past_length()
        self.record()

    def shared(self, first: ir.Node) -> tuple[ir.Value, ir.Value]:
        """(B+1,) cumulative token counts 0, T, … B·T and (B,) past lengths, both int32."""
        tape = ir.tape.Tape()
        zero, one = self.const("zero", 0), self.const("one", 1)
        dims = tape.op("Shape", [first.inputs[0]], {"start": 0, "end": 2})  # (2,) B, T
        b = tape.op("Gather", [dims, zero], {"axis": 0})
        t = tape.op("Gather", [dims, one], {"axis": 0})
        limit = tape.op("Add", [tape.op("Mul", [b, t]), one])
        steps = tape.op("Range", [zero, limit, t])  # 0, T, … B·T
        cumulative = tape.op("Cast", [steps], {"to": ir.DataType.INT32})
        past = tape.op("Cast", [self.lengths], {"to": ir.DataType.INT32})
        cumulative.name, past.name = "paged_cumulative_sequence_length", "paged_past_seqlens"
        insert_tape(self.graph, first, tape)
        for node in tape.nodes:
            node.metadata_props.clear()  # shared by the layers: no one module's name
        return cumulative, past

    def layer(self, node: ir.Node) -> None:
        """One GroupQueryAttention → PagedAttention, its pasts → block pools (docstring, 1-2)."""
        inputs = list(node.inputs) + [None] * (PAGED_INPUT_COUNT - len(node.inputs))
        layer = self.pasts[inputs[3].name][1]
        tape = ir.tape.Tape()
        paged: list[ir.Value | None] = [None] * PAGED_INPUT_COUNT
        for gqa_index, paged_index in PASSED_INPUTS.items():
            value = inputs[gqa_index]
            if value is not None and gqa_index < 3:  # (B, T, ·) → packed (B·T, ·)
                value = tape.op("Flatten", [value], {"axis": 2})
            paged[paged_index] = value
        pools = [self.pool(inputs[3], contract.KEY_BLOCKS, layer),
                 self.pool(inputs[4], contract.VALUE_BLOCKS, layer)]  # fmt: skip
        paged[3:8] = [*pools, self.cumulative, self.past_seqlens, self.table]
        attrs = {k: a for k, a in node.attributes.items() if k in PASSED_ATTRIBUTES}
        out, key_out, value_out = tape.op_multi_out(
            "PagedAttention", paged, attrs, domain=MS_DOMAIN, num_outputs=3
        )
        query = inputs[0]
        out.type = ir.TensorType(inputs[3].dtype)
        target = tape.op(
            "Concat",
            [tape.op("Shape", [query], {"start": 0, "end": 2}), self.const("rest", [-1])],
            {"axis": 0},
        )
        y = tape.op("Reshape", [out, target])
        # the attention's dtype is the cache's (PagedAttention's T)
        y.type, y.shape = ir.TensorType(inputs[3].dtype), node.outputs[0].shape
        insert_tape(self.graph, node, tape)
        replace_value(node.outputs[0], y)
        for present, pool, new, role in (
            (node.outputs[1], pools[0], key_out, contract.KEY_BLOCKS),
            (node.outputs[2], pools[1], value_out, contract.VALUE_BLOCKS),
        ):
            self.present(present, pool, new, role, layer)
        self.graph.remove(node, safe=True)

    def const(self, name: str, value) -> ir.Value:
        """An int64 constant shared by the layers (scalar or 1-D)."""
        if name not in self.consts:
            array = np.array(value, np.int64)
            self.consts[name] = add_initializer(self.graph, f"paged_{name}", array)
        return self.consts[name]

    def pool(self, past: ir.Value, role: str, layer: int) -> ir.Value:
        """The block pool that replaces the past input ``past`` (same position, same dtype)."""
        pool = ir.Value(
            name=contract.BLOCK_NAMES[role].format(layer),
            type=past.type,
            shape=ir.Shape([contract.BLOCKS_DIM, self.block_size, past.shape[1], past.shape[3]]),
        )
        inputs = self.graph.inputs
        inputs[list(inputs).index(past)] = pool
        contract.drop_roles(self.model, [past.name])
        contract.set_role(self.model, pool.name, role, layer)
        return pool

    def present(
        self, present: ir.Value, pool: ir.Value, new: ir.Value, role: str, layer: int
    ) -> None:
        """The output aliasing ``pool`` replaces the present output ``present``."""
        new.name = contract.PRESENT_BLOCK_NAMES[role].format(layer)
        new.type, new.shape = pool.type, pool.shape
        outputs = self.graph.outputs
        if present in outputs:
            outputs[list(outputs).index(present)] = new
            contract.drop_roles(self.model, [present.name])
        else:
            outputs.append(new)
        contract.set_role(self.model, new.name, role, layer)
        self.aliases[new.name] = pool.name

    def drop_unread_past_length(self) -> None:
        names = contract.names_with_role(self.model, contract.PAST_LENGTH)
        for value in [v for v in self.graph.inputs if v.name in names]:
            if not value.uses():
                self.graph.inputs.remove(value)
                contract.drop_roles(self.model, [value.name])

    def record(self) -> None:
        """The layout, in the model's metadata (docstring, 3)."""
        past = next(v for v in self.graph.inputs if v.name in self.aliases.values())
        self.model.metadata_props[contract.KV_LAYOUT_KEY] = PAGED
        self.model.metadata_props[contract.KV_PAGED_KEY] = json.dumps(
            {
                "kind": PAGED,
                "op": f"{MS_DOMAIN}.PagedAttention",
                "block_size": self.block_size,
                "blocks_dim": contract.BLOCKS_DIM,
                "table_dim": contract.TABLE_DIM,
                "kv_num_heads": past.shape[2],
                "head_size": past.shape[3],
                "dtype": past.dtype.name.lower(),
                "layers": len(self.aliases) // 2,
                "block_table": self.table.name,
                "row_lengths": self.lengths.name,
                "present_aliases_past": self.aliases,
                "tokens": "(batch, T), T new tokens per row, packed inside the graph",
            },
            sort_keys=True,
        )


def lower_to_paged(model: ir.Model, block_size: int = 16) -> None:
    """Page the KV cache of a finished ``ort-cuda`` graph (fp16 or bf16, ``kv_cache=True``, per-row
    lengths) in place: :class:`PagedAttentionPass`, then a check that it happened. Raises
    ``ValueError`` saying which layer could not be paged and why; a graph already paged is
    left as it is."""
    paging = PagedAttentionPass(block_size)
    paging(model)
    if paging.refused is not None:
        raise ValueError(f"the KV cache cannot be paged: {paging.refused}")
