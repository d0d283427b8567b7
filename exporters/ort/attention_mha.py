"""``com.microsoft.MultiHeadAttention`` built for one canonical attention (the ``ort`` target's
choice, :func:`tfgraph.exporters.ort.target.lower_attention`), with the pieces of the case's
:class:`~tfgraph.passes.lower.attention_builder.AttentionBuilder` ``b``:

- :func:`mha`: on (B, S, H·d), K/V heads repeat-interleaved, any causal/window mask folded
  into ``attention_bias``;
- :func:`mha_sink`: the same with attention sinks as one more key.
"""

from __future__ import annotations

import onnx_ir as ir

from tfgraph.exporters.ort.ops import MS_DOMAIN, MULTI_HEAD_ATTENTION
from tfgraph.passes.canonical import AttentionOp
from tfgraph.passes.lower.attention_builder import AttentionBuilder
from tfgraph.passes.recognize.attention.sink import sink_column


def mha(
    b: AttentionBuilder, v: ir.Value, attention_bias: ir.Value | None, spec: AttentionOp
) -> ir.Value:
    """MultiHeadAttention with 3-D (B, S, H·d) inputs: 4-D K/V measured slower (no flash
    path). ``attention_bias`` already carries any causal/window mask."""
    inputs = [
        b.to_bsh(b.q, "q"),
        b.expand_heads_bsh(b.k, spec, "k"),
        b.expand_heads_bsh(v, spec, "v"),
    ]
    if attention_bias is not None:
        inputs += [None, None, attention_bias]  # bias, key_padding_mask, attention_bias
    attrs = {"num_heads": spec.num_heads, "scale": spec.scale}
    y = b.tape.op(MULTI_HEAD_ATTENTION, inputs, attrs, domain=MS_DOMAIN)
    return b.from_bsh(y, spec.num_heads)


def _with_zero_row(b: AttentionBuilder, x: ir.Value) -> ir.Value:
    """(B, H, S, d) → (B, H, S + 1, d), the last key (or value) zeros."""
    tape = b.tape
    shape = tape.op(
        "Concat",
        [tape.op("Shape", [x], {"end": 2}), b.ints("one1", [1]), b.dim(x, 3)],
        {"axis": 0},
    )
    zeros = tape.op("Expand", [b.scalar("zero_f", 0), shape])
    return tape.op("Concat", [x, zeros], {"axis": 2})


def mha_sink(
    b: AttentionBuilder, v: ir.Value, bias: ir.Value | None, spec: AttentionOp, sink
) -> ir.Value:
    """MultiHeadAttention with the sink as one more key: K and V get a zero row (its score
    q·0 is 0) and the mask a column holding each head's sink logit, so the softmax's
    denominator takes exp(sink) and the output nothing from it: exactly a sink, for the
    head sizes GroupQueryAttention refuses (MLA's narrower V)."""
    tape = b.tape
    mask = b.full_mask(bias, spec, causal=spec.causal, window=spec.window)
    if mask is None:  # (1, 1, T, S) of zeros
        shape = tape.op(
            "Concat",
            [b.ints("ones2", [1, 1]), b.dim(b.q, 2), b.dim(b.k, 2)],
            {"axis": 0},
        )
        mask = tape.op("Expand", [b.scalar("zero_f", 0), shape])
    heads = b.ints("heads_shape", [1, spec.num_heads, 1, 1])
    mask = tape.op("Expand", [mask, heads])  # (B or 1, Hq, T, S)
    mask = tape.op("Concat", [mask, sink_column(tape, mask, sink, b.ints)], {"axis": -1})
    inputs = [
        b.to_bsh(b.q, "q"),
        b.expand_heads_bsh(_with_zero_row(b, b.k), spec, "k"),
        b.expand_heads_bsh(_with_zero_row(b, v), spec, "v"),
        None,
        None,
        mask,
    ]
    attrs = {"num_heads": spec.num_heads, "scale": spec.scale}
    y = tape.op(MULTI_HEAD_ATTENTION, inputs, attrs, domain=MS_DOMAIN)
    return b.from_bsh(y, spec.num_heads)
