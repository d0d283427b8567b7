"""``com.microsoft.GroupQueryAttention`` built for one canonical attention (the ``ort`` target's
choice, :func:`tfgraph.exporters.ort.target.lower_attention`), with the pieces of the case's
:class:`~tfgraph.passes.lower.attention_builder.AttentionBuilder` ``b``:

- :func:`gqa`: S == T, no past::

       Q ─ Transpose ─ Reshape ─┐ (B, T, Hq·d)
       K ─ Transpose ─ Reshape ─┤ (B, S, Hkv·d)
       V ─ Transpose ─ Reshape ─┤                  ┌─ Reshape ─ Transpose ─► Y
       Shape(K) ─► S−1, S ──────┤ seqlens_k, total ├
       bias ─ Expand(…, T, S) ──┴► GroupQueryAttention

- :func:`gqa_past`: the same with ``past_key``/``past_value`` (a cached layer: the kernel
  appends the new keys and values itself).
"""

from __future__ import annotations

import onnx_ir as ir

from tfgraph.exporters.ort.ops import GROUP_QUERY_ATTENTION, MS_DOMAIN
from tfgraph.passes.cache.row_lengths import row_lengths_value
from tfgraph.passes.canonical import AttentionOp
from tfgraph.passes.lower.attention_builder import AttentionBuilder, has_full_query_axis
from tfgraph.passes.rewrite_utils import replace_value


def _attributes(spec: AttentionOp, causal: bool, window: int) -> dict:
    attrs = {
        "num_heads": spec.num_heads,
        "kv_num_heads": spec.kv_num_heads,
        "scale": spec.scale,
        "causal": int(causal),
    }
    if spec.softcap:
        attrs["softcap"] = spec.softcap  # measured: tanh before the mask, as canonical
    if window:
        attrs["local_window_size"] = window  # measured: same semantics as our window
    return attrs


def gqa(
    b: AttentionBuilder,
    v: ir.Value,
    bias: ir.Value | None,
    spec: AttentionOp,
    sink: ir.Value | None = None,
) -> ir.Value:
    """GroupQueryAttention without a past; only for S == T (checked by the caller)."""
    tape = b.tape
    # local_window_size needs causal=1: a window without causality goes in the bias.
    window = spec.window if spec.causal else 0
    attention_bias = b.full_mask(bias, spec, causal=False, window=spec.window - window)
    s = b.dim0d(b.k, 2)
    seqlens = tape.op("Sub", [s, b.ints("one", 1)])
    seqlens = tape.op("Expand", [seqlens, b.dim(b.k, 0)])  # (B,) = S − 1
    attrs = _attributes(spec, spec.causal, window)
    inputs = [
        b.to_bsh(b.q, "q"),
        b.to_bsh(b.k, "k"),
        b.to_bsh(v, "v"),
        None,  # past_key
        None,  # past_value
        tape.op("Cast", [seqlens], {"to": ir.DataType.INT32}),
        tape.op("Cast", [s], {"to": ir.DataType.INT32}),  # total_sequence_length
    ]
    if attention_bias is not None or sink is not None:
        inputs += [None, None, None, attention_bias]  # cos, sin, position_ids, bias
    if sink is not None:
        inputs.append(sink)  # head_sink (measured: the same denominator as canonical)
    # present_key/present_value are requested although unused: without them ORT 1.32's
    # CPU kernel leaves its flash path and materializes the (Hq, T, S) scores (measured:
    # +2118 MiB at T = S = 8192, Hq = 8, against +7 MiB with them).
    y, _, _ = tape.op_multi_out(
        GROUP_QUERY_ATTENTION, inputs, attrs, domain=MS_DOMAIN, num_outputs=3
    )
    return b.from_bsh(y, spec.num_heads)


def _seqlens(b: AttentionBuilder, total0: ir.Value, new_k: ir.Value) -> ir.Value:
    """(B,) past + new − 1 per row: each row's own past length where the graph has them
    (in-flight batching), else the common one."""
    tape = b.tape
    rows = row_lengths_value(b.graph)
    if rows is not None:
        return tape.op("Add", [rows, tape.op("Sub", [b.dim(new_k, 2), b.ints("one", 1)])])
    return tape.op("Expand", [tape.op("Sub", [total0, b.ints("one", 1)]), b.dim(new_k, 0)])


def gqa_past(
    b: AttentionBuilder,
    cached: tuple,
    bias: ir.Value | None,
    spec: AttentionOp,
    sink: ir.Value | None = None,
) -> ir.Value:
    """GroupQueryAttention with ``past_key``/``past_value``: it appends the new keys and
    values itself (its ``present_*`` become the graph's present outputs, replacing the
    KV-cache pass's Concat) and stays on its flash path at prefill. ORT 1.32 refuses
    batch > 1 with both a past and more than one new token (measured), which
    ``tfgraph.runtime`` never does: prefill has no past, decode one token."""
    tape = b.tape
    past_k, new_k, past_v, new_v, present_k, present_v = cached
    total = tape.op("Add", [b.dim(past_k, 2), b.dim(new_k, 2)])  # (1,) P + T
    total0 = tape.op("Squeeze", [total])
    seqlens = _seqlens(b, total0, new_k)
    attrs = _attributes(spec, True, spec.window)
    inputs = [
        b.to_bsh(b.q, "q"),
        b.to_bsh(new_k, "k"),
        b.to_bsh(new_v, "v"),
        past_k,
        past_v,
        tape.op("Cast", [seqlens], {"to": ir.DataType.INT32}),
        tape.op("Cast", [total0], {"to": ir.DataType.INT32}),
    ]
    if bias is not None and not has_full_query_axis(bias, b.q, present_k):
        shape = tape.op("Concat", [b.ints("ones2", [1, 1]), b.dim(b.q, 2), total], {"axis": 0})
        bias = tape.op("Expand", [bias, shape])  # (B or 1, Hq or 1, T, P + T)
    if bias is not None or sink is not None:
        inputs += [None, None, None, bias]
    if sink is not None:
        inputs.append(sink)  # head_sink
    y, key, value = tape.op_multi_out(
        GROUP_QUERY_ATTENTION, inputs, attrs, domain=MS_DOMAIN, num_outputs=3
    )
    for new, old in ((key, present_k), (value, present_v)):
        new.shape, new.type = old.shape, old.type
        replace_value(old, new)
    return b.from_bsh(y, spec.num_heads)
