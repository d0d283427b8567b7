"""The canonical ops of the ``tfgraph`` domain, one dataclass each, with ``make``/``read``.

Recognition rules emit them (``spec.make(op, *inputs)`` inside an onnxscript rewrite), the
analysis passes refine them (``spec.replace(...).write(node)``) and every target's lowering
reads them (``AttentionOp.read(node)``). Nothing else spells their attributes.

- ``tfgraph.Attention(Q, K, V[, bias[, sink]])``: Q (B, Hq, T, d); K, V (B, Hkv, S, d), not
  expanded for GQA/MQA; ``Y = softmax(scale·Q·Kᵀ + causal/window mask + bias) ·
  repeat_interleave(V)``. ``sink`` (Hq,), attention sinks (gpt-oss): one more logit per head in
  the softmax's denominator, ``p_j = exp(s_j) / (Σ_k exp(s_k) + exp(sink_h))`` (the bias slot
  is empty when there is a sink and no bias). ``tfgraph.SinkSoftmax(s, sink)`` is that softmax
  over the last axis, made by the sink rules for the core rules to take.
  ``causal_alignment``: ``bottom_right`` (key j visible from query i iff j ≤ i + S − T) or
  ``top_left`` (iff j ≤ i); ``window`` (0: none; else key j also masked when
  (i + S − T) − j ≥ window); ``bias_kind``: ``none``, ``additive``, ``alibi``, ``relative``,
  ``padding``, ``prompt_block`` (with ``causal=0``: the bias, kept, masks every later key
  except where the step's own token ids open a block, as Gemma 3's image tokens see their whole
  image at the prompt; computed from the new tokens alone, so the KV cache pass caches it as a
  causal bias: :mod:`.recognize.attention.prompt_block`); ``cached``: K and V are
  ``Concat(past, new, axis=2)`` made by the KV-cache pass (a target with an appending kernel
  takes past and new apart); ``softcap`` (0: none; else the scaled scores become
  ``softcap · tanh(scores / softcap)`` before the mask and bias).
- ``tfgraph.LayerNorm(x[, γ[, β]])`` and ``tfgraph.RMSNorm(x[, γ])`` over the last axis, with
  ``epsilon``.
- ``tfgraph.Gelu(x)`` with ``approximate`` ``none`` (erf) or ``tanh``.
- ``tfgraph.LinearAttention(q, k, v[, past_state[, decay[, beta]]]) → (y, present_state)``:
  a linear-attention recurrence over the T tokens, the inputs packed (B, T, H·d) as ONNX
  Runtime's ``com.microsoft.LinearAttention`` takes them; state S (B, H, d_k, d_v), zeros
  when ``past_state`` is absent; ``update_rule`` ``linear`` (S ← S + k⊗v), ``gated``
  (S ← e^g·S + k⊗v), ``delta`` (S ← S + β·k⊗(v − Sᵀk)), ``gated_delta`` (S ← e^g·S +
  β·k⊗(v − e^g·Sᵀk)); y_t = scale·Sᵀq_t after the update. ``decay`` g (log space) is
  (B, T, H) per head or (B, T, H·d_k) per key dimension; ``beta`` (B, T, H). Here q, k and
  v have the same head count H (grouped heads are repeated before the op).
  ``present_state`` is the state after the last token; ``cached``: the KV-cache pass gave it
  a ``past_state`` graph input and made ``present_state`` a graph output.
- ``tfgraph.CausalConv(x, weight[, bias[, past_state]]) → (y, present_state)``: a causal
  depthwise convolution along the last axis of x (B, C, T), weight (C, 1, K), as
  ``com.microsoft.CausalConvWithState``: y_t = act(Σ_j w_j·x_{t−K+1+j} + b) reading
  ``past_state`` (B, C, K − 1), zeros when absent, before x; ``present_state`` the last
  K − 1 columns of ``Concat(past_state, x)``; ``activation`` ``none`` or ``silu``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import onnx_ir as ir

DOMAIN = "tfgraph"


def is_canonical(node: ir.Node, op_type: str | None = None) -> bool:
    return node.domain == DOMAIN and (op_type is None or node.op_type == op_type)


class _Canonical:
    OP: ClassVar[str]

    def attributes(self) -> dict:
        return {f.name: _attr_value(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def make(self, op, *inputs, **kwargs):
        """Emit the op inside an onnxscript rewrite (``op`` is the rewriter's builder)."""
        return getattr(op, self.OP)(*inputs, _domain=DOMAIN, **self.attributes(), **kwargs)

    def write(self, node: ir.Node) -> None:
        """Set these attributes on an existing canonical node."""
        for name, value in self.attributes().items():
            node.attributes[name] = ir.convenience.convert_attribute(name, value)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def _attr_value(value):
    return int(value) if isinstance(value, bool) else value


@dataclass(frozen=True)
class AttentionOp(_Canonical):
    OP: ClassVar[str] = "Attention"
    BIAS: ClassVar[int] = 3  # input slot of the bias

    num_heads: int
    kv_num_heads: int
    scale: float
    causal: bool = False
    causal_alignment: str = "bottom_right"
    window: int = 0
    bias_kind: str = "none"
    cached: bool = False
    softcap: float = 0.0

    @property
    def group(self) -> int:
        return self.num_heads // self.kv_num_heads

    @property
    def bottom_right(self) -> bool:
        return self.causal_alignment == "bottom_right"

    @classmethod
    def read(cls, node: ir.Node, head_size: int | None = None) -> AttentionOp:
        """The node's attributes; ``head_size`` gives the default scale if none is stated."""
        attrs = node.attributes
        num_heads = attrs.get_int("num_heads")
        kv_num_heads = attrs.get_int("kv_num_heads", num_heads)
        if num_heads is None or kv_num_heads is None or num_heads % kv_num_heads:
            raise ValueError(f"{node.name}: num_heads {num_heads} and kv_num_heads {kv_num_heads}")
        scale = attrs.get_float("scale")
        if scale is None:  # the canonical op states it; the kernels' default, if ever absent
            if not isinstance(head_size, int):
                raise ValueError(f"{node.name}: no scale and no static head size")
            scale = head_size**-0.5
        return cls(
            num_heads=num_heads,
            kv_num_heads=kv_num_heads,
            scale=scale,
            causal=bool(attrs.get_int("causal", 0)),
            causal_alignment=attrs.get_string("causal_alignment", "bottom_right"),
            window=attrs.get_int("window", 0),
            bias_kind=attrs.get_string("bias_kind", "none"),
            cached=bool(attrs.get_int("cached", 0)),
            softcap=attrs.get_float("softcap", 0.0),
        )


SINK_SLOT = 4  # tfgraph.Attention(Q, K, V, bias, sink)
SINK_SOFTMAX = "SinkSoftmax"


def attention_bias(node: ir.Node) -> ir.Value | None:
    return node.inputs[AttentionOp.BIAS] if len(node.inputs) > AttentionOp.BIAS else None


def attention_sink(node: ir.Node) -> ir.Value | None:
    return node.inputs[SINK_SLOT] if len(node.inputs) > SINK_SLOT else None


def require_lowered_attention(model: ir.Model, pass_: object, what: str, after: str) -> None:
    """The precondition of a pass over lowered attention: no ``tfgraph.Attention`` left.
    ``what`` the pass builds, ``after`` the passes it runs after (both for the message)."""
    if any(is_canonical(n, AttentionOp.OP) for n in model.graph):
        raise ir.passes.PreconditionError(
            f"{what} needs lowered attention, but tfgraph.Attention is still in the graph: "
            f"run {type(pass_).__name__} after {after}"
        )


def drop_attention_bias(node: ir.Node) -> None:
    """Remove the bias input of a canonical attention, keeping its sink."""
    if attention_sink(node) is not None:
        node.replace_input_with(AttentionOp.BIAS, None)
    else:
        node.resize_inputs(AttentionOp.BIAS)


@dataclass(frozen=True)
class _NormOp(_Canonical):
    epsilon: float

    @classmethod
    def read(cls, node: ir.Node):
        return cls(epsilon=node.attributes["epsilon"].value)


@dataclass(frozen=True)
class LayerNormOp(_NormOp):
    OP: ClassVar[str] = "LayerNorm"


@dataclass(frozen=True)
class RMSNormOp(_NormOp):
    OP: ClassVar[str] = "RMSNorm"


NORM_OPS: dict[str, type] = {"LayerNorm": LayerNormOp, "RMSNorm": RMSNormOp}


def norm_op(op_type: str, epsilon: float) -> LayerNormOp | RMSNormOp:
    return NORM_OPS[op_type](epsilon=epsilon)


@dataclass(frozen=True)
class GeluOp(_Canonical):
    OP: ClassVar[str] = "Gelu"
    approximate: str = "none"

    @classmethod
    def read(cls, node: ir.Node) -> GeluOp:
        return cls(approximate=node.attributes.get_string("approximate", "none"))


@dataclass(frozen=True)
class LinearAttentionOp(_Canonical):
    OP: ClassVar[str] = "LinearAttention"
    PAST_STATE: ClassVar[int] = 3  # input slot of the carried state
    RULES: ClassVar[tuple[str, ...]] = ("linear", "gated", "delta", "gated_delta")

    q_num_heads: int
    kv_num_heads: int
    update_rule: str
    scale: float
    cached: bool = False

    @classmethod
    def read(cls, node: ir.Node) -> LinearAttentionOp:
        attrs = node.attributes
        return cls(
            q_num_heads=attrs.get_int("q_num_heads"),
            kv_num_heads=attrs.get_int("kv_num_heads"),
            update_rule=attrs.get_string("update_rule"),
            scale=attrs.get_float("scale"),
            cached=bool(attrs.get_int("cached", 0)),
        )


@dataclass(frozen=True)
class CausalConvOp(_Canonical):
    OP: ClassVar[str] = "CausalConv"
    PAST_STATE: ClassVar[int] = 3  # input slot of the carried state

    activation: str = "none"
    cached: bool = False

    @classmethod
    def read(cls, node: ir.Node) -> CausalConvOp:
        attrs = node.attributes
        return cls(
            activation=attrs.get_string("activation", "none"),
            cached=bool(attrs.get_int("cached", 0)),
        )


RECURRENT_OPS: dict[str, type] = {"LinearAttention": LinearAttentionOp, "CausalConv": CausalConvOp}
