"""A rule that turns a standard ONNX ``Attention`` (opsets 23 and 24) into ``tfgraph.Attention``.

torch.onnx exports ``F.scaled_dot_product_attention`` at opset ≥ 23 as one ``Attention`` node.
Recognized, it is lowered per profile like any other core (``ort``: GroupQueryAttention or
MultiHeadAttention; ``tensorrt``: standard ops), instead of being left as exported::

    Attention(Q, K, V[, attn_mask], is_causal, scale)
      ─► tfgraph.Attention(Q, K, V[, bias], num_heads=Hq, kv_num_heads=Hkv, scale, causal,
                           causal_alignment)

- 4-D Q (B, Hq, T, d), K and V (B, Hkv, S, d) pass as they are. 3-D ones (B, T, H·d), with the
  ``q_num_heads`` / ``kv_num_heads`` attributes, are viewed as 4-D (Reshape, Transpose) and the
  result is viewed back as (B, T, Hq·d).
- ``is_causal=1`` without a past is top-left (the spec's offset is ``past_sequence_length``, 0
  here; docs/attention-lowering.md, "is_causal alignment"): ``causal=1``,
  ``causal_alignment="top_left"``.
- ``scale``: the attribute, else 1/√d (d static).
- ``attn_mask``: a float mask is the additive bias; a bool mask (True: attend) becomes
  ``Where(mask, 0, lowest)`` with the dtype's lowest finite value, as the lowering's masks do.
  A fully masked row therefore averages V instead of the spec's zero row.

Rejections (``check`` reasons): an opset other than 23 or 24; ``past_key``/``past_value`` or
``nonpad_kv_seqlen`` given; ``present_*`` or ``qk_matmul_output`` used; ``softcap`` ≠ 0; a
``softmax_precision`` other than the inputs' type; ranks other than all 4-D or all 3-D; head
counts or head sizes not static (or not dividing); V's head size neither Q's nor static (a
static narrower one is multi-head latent attention's, DeepSeek's, and fuses); a mask whose key
axis is not provably S (the spec pads a shorter one with −inf) or whose type is neither bool
nor the inputs' type.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from tfgraph.passes.canonical import AttentionOp

OPSETS = (23, 24)


@dataclass(frozen=True)
class _Spec:
    rank: int
    num_heads: int
    kv_num_heads: int
    scale: float
    causal: bool
    mask: ir.Value | None


def _same(x, y) -> bool:
    """Two dims provably equal: equal ints, or the same named symbol."""
    if x is None or y is None or isinstance(x, int) != isinstance(y, int):
        return False
    return x == y if isinstance(x, int) else (x.value is not None and x.value == y.value)


def _heads(attrs, name: str, x: ir.Value, rank: int) -> tuple[int | None, object]:
    """(heads, head size) of Q, K or V as the spec reads them; heads None when not static."""
    if rank == 4:
        heads, size = x.shape[1], x.shape[3]
        return (heads if isinstance(heads, int) else None), size
    heads, hidden = attrs.get_int(name), x.shape[2]
    if not isinstance(heads, int) or not isinstance(hidden, int) or heads <= 0 or hidden % heads:
        return None, None
    return heads, hidden // heads


class OnnxAttentionRule(pattern.RewriteRuleClassBase):
    """ONNX ``Attention`` → ``tfgraph.Attention`` (module docstring). The node is left for the
    unused-node cleanup (``remove_nodes=False``) so that a used extra output is rejected by
    ``check`` with its reason rather than by the matcher's generic one."""

    def __init__(self) -> None:
        super().__init__("OnnxAttention", remove_nodes=False)

    def pattern(self, op, q, k, v):
        return op.Attention(q, k, v, _allow_other_inputs=True, _outputs=["y"])

    def check(self, context, q, k, v, y, **_):
        result = pattern.MatchResult()
        node = y.producer()
        attrs = node.attributes
        opset = context.model.opset_imports.get("", context.model.opset_imports.get("ai.onnx"))
        if opset not in OPSETS:
            return result.fail(f"Attention at opset {opset}: only opsets 23 and 24 are known", y)
        extra = (list(node.inputs) + [None] * 7)[4:7]
        if extra[0] is not None or extra[1] is not None:
            return result.fail("past_key/past_value given (a KV cache)", y)
        if extra[2] is not None:
            return result.fail("nonpad_kv_seqlen given (an external KV cache)", y)
        if any(out.uses() or out.is_graph_output() for out in node.outputs[1:]):
            return result.fail("present_key/present_value or qk_matmul_output is used", y)
        if attrs.get_float("softcap", 0.0) != 0.0:
            return result.fail("softcap is not 0", y)
        precision = attrs.get_int("softmax_precision")
        if precision is not None and precision != q.dtype:
            return result.fail("softmax_precision differs from the inputs' type", y)
        ranks = {x.shape.rank() if x.shape is not None else None for x in (q, k, v)}
        if ranks not in ({4}, {3}):
            return result.fail("Q, K, V are not all 4-D or all 3-D with known shapes", y)
        rank = ranks.pop()
        hq, dq = _heads(attrs, "q_num_heads", q, rank)
        hk, _ = _heads(attrs, "kv_num_heads", k, rank)
        hv, dv = _heads(attrs, "kv_num_heads", v, rank)
        if hq is None or hk is None or hv is None or hk != hv or hq % hk:
            return result.fail("head counts not static, or KV heads do not divide Q heads", y)
        if not (_same(dq, dv) or isinstance(dv, int)):  # MLA: V narrower than Q (static)
            return result.fail("V's head size is neither provably Q's nor static", v)
        scale = attrs.get_float("scale")
        if scale is None and not isinstance(dq, int):
            return result.fail("no scale attribute and no static head size", q)
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        if mask is not None:
            if mask.shape is None or not 1 <= mask.shape.rank() <= 4:
                return result.fail("attn_mask's shape is unknown", mask)
            if not _same(mask.shape[-1], k.shape[rank - 2]):
                return result.fail("attn_mask's key axis is not provably S", mask)
            if q.dtype is None or mask.dtype not in (ir.DataType.BOOL, q.dtype):
                return result.fail("attn_mask is neither bool nor of the inputs' known type", mask)
        self._spec = _Spec(
            rank=rank,
            num_heads=hq,
            kv_num_heads=hk,
            scale=scale if scale is not None else dq**-0.5,
            causal=bool(attrs.get_int("is_causal", 0)),
            mask=mask,
        )
        return result

    def rewrite(self, op, q, k, v, y, **_):
        spec = self._spec
        if spec.rank == 3:
            q = _to_heads(op, q, spec.num_heads)
            k = _to_heads(op, k, spec.kv_num_heads)
            v = _to_heads(op, v, spec.kv_num_heads)
        bias = spec.mask
        if bias is not None and bias.dtype == ir.DataType.BOOL:
            dtype = q.dtype.numpy()
            zero = op.Constant(value=ir.tensor(np.array(0, dtype=dtype)))
            lowest = op.Constant(value=ir.tensor(np.array(np.finfo(dtype).min, dtype=dtype)))
            mask = bias
            bias = op.Where(mask, zero, lowest)
            bias.shape, bias.type = mask.shape, ir.TensorType(q.dtype)
        canonical = AttentionOp(
            num_heads=spec.num_heads,
            kv_num_heads=spec.kv_num_heads,
            scale=float(spec.scale),
            causal=spec.causal,
            causal_alignment="top_left" if spec.causal else "bottom_right",
            bias_kind="additive" if bias is not None else "none",
        )
        out = canonical.make(op, *([q, k, v] + ([bias] if bias is not None else [])))
        if spec.rank == 4:
            return out
        b, t = q.shape[0], q.shape[2]
        out.shape, out.type = ir.Shape([b, spec.num_heads, t, v.shape[3]]), q.type
        bthd = op.Transpose(out, perm=[0, 2, 1, 3])
        return op.Reshape(bthd, op.Constant(value=ir.tensor(np.array([0, 0, -1], np.int64))))


def _to_heads(op, x: ir.Value, heads: int) -> ir.Value:
    """(B, L, H·d) → (B, H, L, d), with the shape it is known to have."""
    b, length, hidden = x.shape
    shape = op.Constant(value=ir.tensor(np.array([0, 0, heads, hidden // heads], np.int64)))
    y = op.Transpose(op.Reshape(x, shape), perm=[0, 2, 1, 3])
    y.shape, y.type = ir.Shape([b, heads, length, hidden // heads]), x.type
    return y


RULES = [OnnxAttentionRule.rule()]
