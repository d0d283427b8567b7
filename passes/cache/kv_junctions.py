"""Where token data meets the machinery, for the KV cache pass.

A *junction* is a data input of a token op that reads machinery (an ``Add`` of position rows,
a ``Mul`` by cos/sin, a bias into the attention): after the cache the machinery is computed at
the total length L = past + T, and the junction gets its last T rows (or each row's own rows).
:func:`find_junctions` lists them with the axes to cut. A bias computed from the tokens
(Shaw's ``q·r``) is followed back from the attention's key axis first (:func:`key_axes`): the
machinery it reads keeps L along the axes that become keys.
"""

from __future__ import annotations

import onnx_ir as ir

from tfgraph.passes.cache.kv_analysis import (
    BIAS_SLOT,
    Analysis,
    KVCacheError,
    bounded_by,
    flattened,
    has_seq,
    is_attention,
)
from tfgraph.passes.provenance import layer_name
from tfgraph.passes.rewrite_utils import dims_of, int_list, same_dims

# Inputs of token ops that are shapes, not data: they keep the new tokens' length T.
SHAPE_SLOTS = {
    ("Reshape", 1),
    ("Expand", 1),
    ("Tile", 1),
    ("Pad", 1),
    ("Slice", 1),
    ("Slice", 2),
    ("Slice", 3),
    ("Slice", 4),
    ("Squeeze", 1),
    ("Unsqueeze", 1),
    ("Split", 1),
    ("ConstantOfShape", 0),
    ("Range", 0),
    ("Range", 1),
    ("Range", 2),
}

ELEMENTWISE = {
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Where",
    "Pow",
    "Max",
    "Min",
    "Neg",
    "Cast",
    "Relu",
    "Tanh",
    "Sigmoid",
    "Identity",
    "Abs",
    "Exp",
    "Log",
    "Sqrt",
    "Reciprocal",
    "Softplus",
    "Clip",
    "Not",
    "And",
    "Or",
    "Equal",
    "Greater",
    "Less",
    "GreaterOrEqual",
    "LessOrEqual",
}


def _input_key_axes(
    node: ir.Node, index: int, value: ir.Value, out_keys: list[int], out_rank: int, seq: str
) -> list[int]:
    """Axes of input ``index`` that feed the output's key axes (the attention's S axis)."""
    rank = len(value.shape)
    op = node.op_type
    if op in ELEMENTWISE:
        shift = out_rank - rank
        return [a - shift for a in out_keys if a - shift >= 0 and dims_of(value)[a - shift] != 1]
    if op == "Transpose":
        perm = node.attributes.get_ints("perm", list(reversed(range(rank))))
        return [perm[a] for a in out_keys]
    if op in ("Squeeze", "Unsqueeze") and index == 0:
        axes = int_list(node.inputs[1]) if len(node.inputs) > 1 else None
        if axes is not None:
            if op == "Squeeze":
                kept = [i for i in range(rank) if i not in {a % rank for a in axes}]
                return [kept[a] for a in out_keys]
            added = {a % out_rank for a in axes}
            return [a - sum(b < a for b in added) for a in out_keys if a not in added]
    if op in ("Reshape", "Expand") and index > 0:  # a shape
        return []
    if op == "Expand":  # broadcast like an elementwise op
        shift = out_rank - rank
        return [a - shift for a in out_keys if a - shift >= 0 and dims_of(value)[a - shift] != 1]
    if op == "Reshape":  # keys kept where the dims from the key axis on are unchanged
        out_dims = dims_of(node.outputs[0])
        mapped = []
        for a in out_keys:
            tail = out_rank - a
            if tail <= rank and same_dims(dims_of(value)[rank - tail :], out_dims[a:]):
                mapped.append(rank - tail)
            else:
                raise KVCacheError(
                    f"{layer_name(node)}: the attention bias is reshaped across its key axis, "
                    "which the KV cache cannot follow"
                )
        return mapped
    if op == "GatherND" and not node.attributes.get_int("batch_dims", 0):
        # data[indices[..., :]] (Hugging Face's padding_mask[b, kv_idx]): the indices' leading
        # axes are the output's; the data's sequence axis is what they address
        if index == 1:
            return list(out_keys)
        return [i for i, d in enumerate(dims_of(value)) if d == seq] if out_keys else []
    if op == "GatherElements":  # keys gathered along its axis come from the indices
        axis = node.attributes.get_int("axis", 0) % rank
        if index > 0:
            return list(out_keys)
        gathered = dims_of(value)[axis]  # a fixed table (Inkling's relative extent), or keys
        keyed = axis in out_keys and (gathered == seq or flattened(gathered, seq))
        return [a for a in out_keys if a != axis] + ([axis] if keyed else [])
    if op == "ScatterElements":  # data as the output; indices and updates select key slots
        return list(out_keys)
    if op == "TopK":  # the keys it selects from (its k is a count)
        axis = node.attributes.get_int("axis", -1) % rank
        return [axis] if axis in out_keys and index == 0 else []
    if op == "MatMul":
        batch = [a for a in out_keys if a < out_rank - 2]
        shift = out_rank - rank
        mapped = [a - shift for a in batch if a - shift >= 0]
        if index == 0:
            return mapped + ([rank - 2] if out_rank - 2 in out_keys else [])
        return mapped + ([rank - 1] if out_rank - 1 in out_keys else [])
    if op == "Einsum":
        inputs, output = node.attributes.get_string("equation").replace(" ", "").split("->")
        letters = inputs.split(",")[index]
        keys = {output[a] for a in out_keys}
        return [i for i, letter in enumerate(letters) if letter in keys]
    raise KVCacheError(
        f"{layer_name(node)}: the attention bias is computed from the tokens through {op}, "
        "which the KV cache cannot follow"
    )


def key_axes(analysis: Analysis) -> dict[tuple[ir.Node, int], list[int]]:
    """For a bias computed from the tokens (Shaw's ``q·r``): walk back from each attention's
    bias and find, per machinery input on the way, the axes that become the key axis. Those
    keep length L; the token values on the way get an L key axis too
    (``analysis.key_values``). A token value whose only sequence axes become keys (DSA's
    indexer keys, read by a ``MatMul`` with the queries) is cached like K
    (``analysis.cuts``): the walk stops there. Top-k indices (``TopK`` into
    ``ScatterElements``) select key slots: walked through whatever their length."""
    keys: dict[ir.Value, list[int]] = {}
    selections: set[ir.Value] = set()  # values whose key axes hold selected key positions
    for node in analysis.layers:
        bias = node.inputs[BIAS_SLOT] if len(node.inputs) > BIAS_SLOT else None
        if bias is not None and bias in analysis.token and has_seq(bias, analysis.seq):
            if dims_of(bias)[-1] == analysis.seq:
                keys[bias] = [len(bias.shape) - 1]
    junctions: dict[tuple[ir.Node, int], list[int]] = {}
    for node in reversed(list(analysis.graph)):
        out = next((o for o in node.outputs if o in keys), None)
        if out is None or is_attention(node):
            continue
        for index, value in enumerate(node.inputs):
            if value is None or (value not in analysis.token and value not in analysis.machinery):
                continue
            if value.shape is None:
                raise KVCacheError(f"{layer_name(node)}: the shape of '{value.name}' is unknown")
            mapped = _input_key_axes(node, index, value, keys[out], len(out.shape), analysis.seq)
            if node.op_type == "Reshape" and index == 0 and mapped:
                analysis.key_reshapes[node] = min(keys[out])  # its target's tail reads L
            dims = dims_of(value)
            axes = [a for a in mapped if dims[a] == analysis.seq]
            selects = (node.op_type == "ScatterElements" and index > 0) or (
                out in selections and node.op_type != "TopK"
            )
            if selects and mapped and value in analysis.token:
                selections.add(value)
                keys[value] = sorted(set(keys.get(value, [])) | set(mapped))
                continue
            derived = next((dims[a] for a in mapped if flattened(dims[a], analysis.seq)), None)
            if derived is not None and not selects:
                raise KVCacheError(
                    f"{layer_name(node)}: the attention bias reads '{value.name}' along an axis of "
                    f"{derived} (keys pooled into blocks), which the KV cache cannot follow"
                )
            if value in analysis.machinery and (axes or (selects and mapped)):
                # a count of selected keys (``Min(k, sequence)``) is a key axis too
                junctions[(node, index)] = sorted(set(axes) | set(mapped if selects else []))
            elif not axes:
                continue
            elif (
                value.producer() is not None
                and value.producer().op_type != "GatherND"  # addresses its data by position
                and axes == [i for i, d in enumerate(dims) if d == analysis.seq]
            ):
                analysis.cuts.setdefault(value, []).append((node, index))
            elif value.producer() is None:
                raise KVCacheError(
                    f"{layer_name(node)}: the attention bias needs input '{value.name}' for past "
                    "tokens, which the cache does not keep"
                )
            else:
                keys[value] = sorted(set(keys.get(value, [])) | set(axes))
    analysis.key_values = {
        v: [a for a in axes if dims_of(v)[a] == analysis.seq] for v, axes in keys.items()
    }
    return junctions


# (token op, input index, the machinery it reads there, that value's axes to cut to T)
Junction = tuple[ir.Node, int, ir.Value, list[int]]


def find_junctions(
    analysis: Analysis, junction_keys: dict[tuple[ir.Node, int], list[int]]
) -> list[Junction]:
    """Every data input of a token op that reads machinery, with the axes to cut to the new
    tokens: its sequence axes but those that become keys (``junction_keys``, from
    :func:`key_axes`; an attention bias keeps its last, key axis at L)."""
    junctions = []
    for node in list(analysis.graph):
        if not any(o in analysis.token for o in node.outputs):
            continue
        for index, value in enumerate(node.inputs):
            if value is None or value not in analysis.machinery:
                continue
            if (node.op_type, index) in SHAPE_SLOTS and node.domain in ("", "ai.onnx"):
                continue
            keys = junction_keys.get((node, index), [])
            axes = _junction_axes(node, index, value, keys, analysis.seq)
            if axes is not None:
                junctions.append((node, index, value, axes))
    return junctions


def _junction_axes(
    node: ir.Node, index: int, value: ir.Value, key_axes: list[int], seq: str
) -> list[int] | None:
    """The axes of machinery ``value`` that ``node`` reads at the new tokens' positions; None
    where the tokens are flattened into one axis (nothing to cut)."""
    if value.shape is None:
        raise KVCacheError(
            f"{layer_name(node)}: the shape of '{value.name}' is unknown, so its "
            "sequence axes cannot be told apart"
        )
    dims = dims_of(value)
    bounded = next(
        (d for i, d in enumerate(dims) if bounded_by(d, seq) and i not in key_axes),
        None,
    )
    if bounded is not None:
        raise KVCacheError(
            f"{layer_name(node)}: '{value.name}' has a sequence axis of {bounded} (a "
            "buffer sliced to the input), so its rows cannot be told apart from "
            "the new tokens; state the model's position limit (a config with "
            "max_position_embeddings) so that the axis is the sequence"
        )
    if is_attention(node) and index == BIAS_SLOT:
        key_axes = [len(dims) - 1]  # keys stay at L
    axes = [i for i, d in enumerate(dims) if d == seq and i not in key_axes]
    if is_attention(node) and index == BIAS_SLOT and not axes and len(dims) > 1:
        # an attention bias is (…, T or 1, S or 1): a query axis that shape
        # inference lost (a position table sliced to the length, HF MPT's ALiBi)
        # is still the queries
        if not isinstance(dims[-2], int):
            axes = [len(dims) - 2]
    if not axes and not key_axes and any(flattened(d, seq) for d in dims):
        # the tokens flattened into one axis (JetMoE's (batch·T, experts) router
        # buffer): no axis to slice, and its T-length original is what the token
        # op read before the cache (cache parity checks it)
        return None
    return axes
