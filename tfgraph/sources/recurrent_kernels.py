"""Recurrent layers traced as one op each: the kernel entry points of Hugging Face's linear
attention and state-space layers, taken over while tracing.

Hugging Face writes its recurrent layers (Gated DeltaNet, Mamba, Mamba-2's SSD, the causal
convolution before them) as calls to kernel entry points that a faster package may replace:
``use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")`` and so on. Their
PyTorch fallbacks loop in Python over the tokens (or over chunks of 64 of them), which
torch.export cannot trace with a dynamic length: it unrolls the loop for the example's length or
fails. Those entry points are exactly where the recurrence is, with a contract of its own (the
fla / causal-conv1d / mamba_ssm signature), whatever the architecture. While tracing, each such
entry point of the model's modules is replaced by a wrapper that states the same computation
with one custom op per recurrence:

- ``tfgraph::linear_attention`` → ``tfgraph.LinearAttention`` (:mod:`tfgraph.passes.canonical`);
- ``tfgraph::causal_conv`` → ``tfgraph.CausalConv``.

=================================== ===================================================
entry point (kernel name)           as
=================================== ===================================================
``causal_conv1d_fn``                ``CausalConv`` (activation ``silu`` or none)
``chunk_gated_delta_rule``,         ``LinearAttention`` ``gated_delta``, decay per head
``fused_recurrent_gated_delta_rule``
``chunk_kda``,                      ``LinearAttention`` ``gated_delta``, decay per key
``fused_recurrent_kda``             dimension (Kimi Delta Attention)
``mamba_chunk_scan_combined``       ``LinearAttention`` ``gated`` (Mamba-2's SSD: q = C,
                                    k = B, v = Δ·x, decay Δ·A per head), then D·x, z gate
``selective_scan_fn``               ``LinearAttention`` ``gated`` per channel (Mamba-1:
                                    heads = channels, d_k = state size, d_v = 1, decay
                                    Δ·A per key dimension), then D·u, z gate
=================================== ===================================================

The wrappers compute what the fallbacks compute (the tests compare them eagerly); the custom
ops' own PyTorch implementations are the sequential recurrences. What a wrapper cannot state
(packed sequences: ``cu_seqlens``) raises, and the original runs. The cache pass
(:mod:`tfgraph.passes.cache.insert_recurrent_state`) then carries each op's state across steps.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)

DOMAIN = "tfgraph"
_ACTIVATIONS = {None: "none", "silu": "silu", "swish": "silu"}


# -- the custom ops ---------------------------------------------------------------------------


@torch.library.custom_op("tfgraph::linear_attention", mutates_args=())
def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    past_state: Tensor | None,
    decay: Tensor | None,
    beta: Tensor | None,
    heads: int,
    rule: str,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """The recurrence of ``tfgraph.LinearAttention``, token by token (packed (B, T, H·d))."""
    batch, length, _ = q.shape
    dk, dv = q.shape[-1] // heads, v.shape[-1] // heads
    q4, k4 = q.view(batch, length, heads, dk), k.view(batch, length, heads, dk)
    v4 = v.view(batch, length, heads, dv)
    state = q.new_zeros(batch, heads, dk, dv) if past_state is None else past_state.clone()
    out = q.new_zeros(batch, length, heads, dv)
    for t in range(length):
        kt, vt = k4[:, t], v4[:, t]
        if decay is not None:
            g = decay[:, t].view(batch, heads, -1).exp()  # (B, H, 1) or (B, H, dk)
            state = state * g.unsqueeze(-1)
        if rule in ("delta", "gated_delta"):
            predicted = (state * kt.unsqueeze(-1)).sum(-2)
            vt = (vt - predicted) * beta[:, t].view(batch, heads, 1)
        state = state + kt.unsqueeze(-1) * vt.unsqueeze(-2)
        out[:, t] = scale * (state * q4[:, t].unsqueeze(-1)).sum(-2)
    return out.reshape(batch, length, heads * dv), state


@linear_attention.register_fake
def _(q, k, v, past_state, decay, beta, heads, rule, scale):
    batch, length, _ = q.shape
    dk, dv = q.shape[-1] // heads, v.shape[-1] // heads
    return q.new_empty(batch, length, heads * dv), q.new_empty(batch, heads, dk, dv)


@torch.library.custom_op("tfgraph::causal_conv", mutates_args=())
def causal_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, past_state: Tensor | None, activation: str
) -> tuple[Tensor, Tensor]:
    """``tfgraph.CausalConv``: x (B, C, T), weight (C, 1, K)."""
    width = weight.shape[-1]
    if past_state is None:
        past_state = x.new_zeros(x.shape[0], x.shape[1], width - 1)
    full = torch.cat([past_state, x], dim=-1)
    y = F.conv1d(full, weight, bias, groups=x.shape[1])
    if activation == "silu":
        y = F.silu(y)
    return y, full[..., full.shape[-1] - (width - 1) :].clone()


@causal_conv.register_fake
def _(x, weight, bias, past_state, activation):
    return x.new_empty(x.shape), x.new_empty(x.shape[0], x.shape[1], weight.shape[-1] - 1)


# -- their ONNX translations and schemas ------------------------------------------------------


# op → (inputs, the optional ones trailing after ``required``, attributes: name → (kind, required))
_SCHEMAS = {
    "LinearAttention": (
        ("query", "key", "value", "past_state", "decay", "beta"),
        3,
        {
            "q_num_heads": ("INT", True),
            "kv_num_heads": ("INT", True),
            "update_rule": ("STRING", True),
            "scale": ("FLOAT", True),
            "cached": ("INT", False),
        },
    ),
    "CausalConv": (
        ("input", "weight", "bias", "past_state"),
        2,
        {"activation": ("STRING", True), "cached": ("INT", False)},
    ),
}


def _register_schemas() -> None:
    """The ``tfgraph`` domain's recurrent ops (:data:`_SCHEMAS`), known to ONNX so the
    exporter can emit them; outputs (output, present_state) for both."""
    import onnx
    from onnx.defs import OpSchema

    param, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    floats = [("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float types")]
    for op, (inputs, required, attributes) in _SCHEMAS.items():
        if onnx.defs.has(op, DOMAIN):
            continue
        schema = OpSchema(
            op,
            DOMAIN,
            1,
            doc=f"tfgraph.passes.canonical ({op})",
            inputs=[
                param(name, "T") if i < required else param(name, "T", param_option=optional)
                for i, name in enumerate(inputs)
            ],
            outputs=[param("output", "T"), param("present_state", "T")],
            type_constraints=floats,
            attributes=[
                OpSchema.Attribute(name, getattr(OpSchema.AttrType, kind), name, required=req)
                for name, (kind, req) in attributes.items()
            ],
        )
        onnx.defs.register_schema(schema)


def translation_table() -> dict:
    """``custom_translation_table`` for ``torch.onnx.export``: the custom ops as canonical
    ``tfgraph`` ops."""
    import onnxscript

    _register_schemas()
    opset = onnxscript.values.Opset(DOMAIN, 1)

    def linear(q, k, v, past_state, decay, beta, heads: int, rule: str, scale: float):
        op = onnxscript.values.Op(opset, "LinearAttention")
        return op(
            q,
            k,
            v,
            past_state,
            decay,
            beta,
            q_num_heads=heads,
            kv_num_heads=heads,
            update_rule=rule,
            scale=scale,
            _outputs=2,
        )

    def conv(x, weight, bias, past_state, activation: str):
        op = onnxscript.values.Op(opset, "CausalConv")
        return op(x, weight, bias, past_state, activation=activation, _outputs=2)

    return {
        torch.ops.tfgraph.linear_attention.default: linear,
        torch.ops.tfgraph.causal_conv.default: conv,
    }


# -- the wrappers of the kernel entry points ---------------------------------------------------


class NotStated(Exception):
    """A call the wrapper cannot state as the canonical op (the original runs)."""


def _no_packing(kwargs: dict) -> None:
    for name in ("cu_seqlens", "seq_idx"):
        if kwargs.get(name) is not None:
            raise NotStated(f"packed sequences ({name})")


def _l2norm(x: Tensor) -> Tensor:  # as fla (and Hugging Face's fallback) normalize
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _packed(x: Tensor) -> Tensor:
    return x.reshape(x.shape[0], x.shape[1], -1)


def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """causal-conv1d's ``causal_conv1d_fn``: x (B, C, T), weight (C, K)."""
    _no_packing(kwargs)
    if activation not in _ACTIVATIONS:
        raise NotStated(f"activation {activation!r}")
    x = hidden_states.to(weight.dtype)
    y, _ = torch.ops.tfgraph.causal_conv(
        x, weight.unsqueeze(1), bias, None, _ACTIVATIONS[activation]
    )
    return y.to(hidden_states.dtype)


def gated_delta_rule(
    query,
    key,
    value,
    g,
    beta,
    chunk_size=64,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    **kwargs,
):
    """fla's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``: q, k
    (B, T, Hk, dk), v (B, T, Hv, dv), g and beta (B, T, Hv); state (B, Hv, dk, dv). Also
    ``chunk_kda`` / ``fused_recurrent_kda`` (Kimi Delta Attention), whose decay g is
    (B, T, H, dk): one per key dimension."""
    _no_packing(kwargs)
    dtype = query.dtype
    heads, dv = value.shape[-2:]
    if query.shape[-2] != heads:  # each q/k head serves consecutive value heads
        query = query.repeat_interleave(heads // query.shape[-2], dim=2)
        key = key.repeat_interleave(heads // key.shape[-2], dim=2)
    query, key, value = (x.float() for x in (query, key, value))
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    out, state = torch.ops.tfgraph.linear_attention(
        _packed(query),
        _packed(key),
        _packed(value),
        None if initial_state is None else initial_state.float(),
        _packed(g.float()) if g.dim() == 4 else g.float(),
        beta.float(),
        heads,
        "gated_delta",
        query.shape[-1] ** -0.5,
    )
    out = out.view(*value.shape).to(dtype)
    return out, (state if output_final_state else None)


def _time_step(dt, dt_bias, dt_softplus, dt_limit=(0.0, float("inf"))):
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo != 0.0 or hi != float("inf"):
        dt = torch.clamp(dt, min=lo, max=hi)
    return dt


def mamba_chunk_scan_combined(
    hidden_states,
    dt,
    A,
    B,
    C,
    chunk_size=256,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    **kwargs,
):
    """mamba_ssm's ``mamba_chunk_scan_combined`` (Mamba-2's SSD): x (B, T, H, P), dt (B, T, H),
    A (H,), B and C (B, T, G, N); state (B, H, P, N) there, (B, H, N, P) here."""
    _no_packing({"seq_idx": seq_idx, **kwargs})
    batch, length, heads, size = hidden_states.shape
    dt = _time_step(dt.float(), dt_bias, dt_softplus, dt_limit)  # (B, T, H)
    x = hidden_states.float()
    groups = B.shape[2]
    B = B.float().repeat_interleave(heads // groups, dim=2)
    C = C.float().repeat_interleave(heads // groups, dim=2)
    past = None if initial_states is None else initial_states.float().transpose(-1, -2)
    out, state = torch.ops.tfgraph.linear_attention(
        _packed(C),
        _packed(B),
        _packed(x * dt.unsqueeze(-1)),
        past,
        dt * A.float(),
        None,
        heads,
        "gated",
        1.0,
    )
    y = out.view(batch, length, heads, size)
    if D is not None:
        y = y + x * (D.float() if D.dim() == 2 else D.float()[:, None])
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(hidden_states.dtype)
    if return_final_states:
        return y, state.transpose(-1, -2)
    return y


def selective_scan_fn(
    hidden_states,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    return_last_state=False,
    **kwargs,
):
    """mamba_ssm's ``selective_scan_fn`` (Mamba-1): u and dt (B, D, T), A (D, N), B and C
    (B, N, T); state (B, D, N). Each channel is a head of d_k = N, d_v = 1."""
    batch, channels, length = hidden_states.shape
    size = A.shape[-1]
    dt = dt.float()
    if delta_bias is not None:
        dt = dt + delta_bias.float()[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    u = hidden_states.float()
    dt_t = dt.transpose(1, 2)  # (B, T, D)
    decay = dt_t.unsqueeze(-1) * A.float()  # (B, T, D, N)
    key = B.float().transpose(1, 2).unsqueeze(2).expand(batch, length, channels, size)
    query = C.float().transpose(1, 2).unsqueeze(2).expand(batch, length, channels, size)
    value = (dt_t * u.transpose(1, 2)).unsqueeze(-1)  # (B, T, D, 1)
    out, state = torch.ops.tfgraph.linear_attention(
        _packed(query),
        _packed(key),
        _packed(value),
        None,
        _packed(decay),
        None,
        channels,
        "gated",
        1.0,
    )
    y = out.transpose(1, 2)  # (B, D, T)
    if D is not None:
        y = y + u * D.float()[:, None]
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(hidden_states.dtype)
    if return_last_state:
        return y, state.squeeze(-1)
    return y


# kernel name (the first argument of Hugging Face's use_kernel_func_from_hub_with_fallback) →
# the wrapper stated with the canonical ops
WRAPPERS: dict[str, Callable] = {
    "causal_conv1d_fn": causal_conv1d_fn,
    "chunk_gated_delta_rule": gated_delta_rule,
    "fused_recurrent_gated_delta_rule": gated_delta_rule,
    "chunk_kda": gated_delta_rule,
    "fused_recurrent_kda": gated_delta_rule,
    "mamba_chunk_scan_combined": mamba_chunk_scan_combined,
    "selective_scan_fn": selective_scan_fn,
}


def kernel_name(function) -> str | None:
    """The kernel name a Hugging Face kernel entry point was declared with, else None: the
    ``kernel_layer_name`` the ``kernels`` package gives it, or without that package the name
    the fallback wrapper closes over."""
    named = getattr(function, "kernel_layer_name", None)
    if isinstance(named, str):
        return named
    if not callable(function) or not hasattr(function, "__wrapped__"):
        return None
    try:
        name = inspect.getclosurevars(function).nonlocals.get("func_name")
    except (TypeError, ValueError):
        return None
    return name if isinstance(name, str) else None


def _guarded(original: Callable, wrapper: Callable, name: str) -> Callable:
    def call(*args, **kwargs):
        try:
            return wrapper(*args, **kwargs)
        except NotStated as why:
            logger.info("%s runs as written: %s", name, why)
            return original(*args, **kwargs)

    call.__wrapped__ = original
    return call


@contextlib.contextmanager
def substituted(module: torch.nn.Module) -> Iterator[dict[str, int]]:
    """Within the block, every kernel entry point in the modules that define ``module``'s
    submodules is the wrapper of :data:`WRAPPERS`; yields {kernel name: entry points taken}."""
    patched: list[tuple[object, str, object]] = []
    taken: dict[str, int] = {}
    modules = {type(m).__module__ for m in module.modules()}
    for module_name in sorted(modules):
        namespace = sys.modules.get(module_name)
        if namespace is None:
            continue
        for attr, function in list(vars(namespace).items()):
            name = kernel_name(function)
            if name not in WRAPPERS:
                continue
            patched.append((namespace, attr, function))
            setattr(namespace, attr, _guarded(function, WRAPPERS[name], name))
            taken[name] = taken.get(name, 0) + 1
    if taken:
        logger.info("recurrent kernels traced as canonical ops: %s", taken)
    try:
        yield taken
    finally:
        for namespace, attr, function in reversed(patched):
            setattr(namespace, attr, function)
