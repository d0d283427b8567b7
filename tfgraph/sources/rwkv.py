"""RWKV (v4) time mixing traced as one ``tfgraph::linear_attention``, its token shift as one
``tfgraph::causal_conv``.

Hugging Face's ``rwkv_linear_attention`` (the CPU path; the CUDA kernel is never taken while
tracing on the CPU) loops over the tokens in Python: torch.export specializes the sequence to
the example's length. Its ``wkv`` recurrence per channel c, with ``w = −exp(time_decay)`` and
``u = time_first``, is

    wkv_t = (a_{t−1} + e^{u+k_t}·v_t) / (b_{t−1} + e^{u+k_t}),
    a_t = e^w·a_{t−1} + e^{k_t}·v_t,    b_t = e^w·b_{t−1} + e^{k_t}

(Hugging Face carries a, b normalized by a running maximum p: ``a·e^p``). (a, b) is the
``gated`` rule of :func:`tfgraph.sources.recurrent_kernels.linear_attention` with one head per
channel, d_k = 1 and d_v = 2: ``q = 1``, ``k = e^{k_t}``, ``v = (v_t, 1)``, a constant decay
``w`` per head; the op's output after the update is (a_t, b_t). The token's output needs
(a, b)_{t−1} undecayed: the op's output shifted by one token (the causal convolution below),
whose first value is the previous step's last (a, b), plus the current token's bonus
``e^{u+k_t}·(v_t, 1)``. No subtraction, so no cancellation; the cache pass carries (a, b)
twice per layer, as the op's (B, C, 1, 2) state and as the shift's (B, 2C, 1) state (an op
whose output is read before the update, fla's RWKV rule with its ``u`` bonus, would carry
it once).

Stability: without the running maximum the state is exact while it is finite. In fp32
``e^{k}`` overflows for k > 88 (a sum over T tokens for k > 88 − ln T), and the denominator
underflows to 0 where ``u + k_t`` and every earlier ``k_i + (t−1−i)·w`` are below about −87
(then 0/0). The computation stays in fp32 whatever the model's dtype; the state is fp32.

Eager RWKV in eval mode divides block i's output projections by 2^(i // rescale_every) in
place on its first forward; torch.export keeps that division as graph ops on the parameters.

The token shift (``nn.ZeroPad2d((0, 0, 1, −1))`` on (B, T, C): x_{t−1}, zeros before the
first token) of both the time and the channel mixing is a depthwise causal convolution of
width 2 with weights (1, 0), whose carried state is the previous token's input, as Hugging
Face's ``state[0]`` / ``state[1]`` are.

Modules are recognized by what they hold: a modeling module defining
``rwkv_linear_attention(time_decay, time_first, key, value, state, return_state)``, and a
``time_shift`` pad of (0, 0, 1, −1) in a module with ``time_mix_key``. With a state (decode in
eager Hugging Face, never while tracing) the originals run.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import types
from collections.abc import Iterator

import torch
from torch import nn

from tfgraph.sources import recurrent_kernels  # noqa: F401 - registers the tfgraph ops

logger = logging.getLogger(__name__)

ENTRY_POINT = "rwkv_linear_attention"
ENTRY_PARAMS = ("time_decay", "time_first", "key", "value", "state", "return_state")
SHIFT = (0, 0, 1, -1)  # ZeroPad2d: one row of zeros before the tokens, the last row dropped


def wkv(
    time_decay: torch.Tensor,
    time_first: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rwkv_linear_attention`` from a zero state: (wkv (B, T, C) in ``key``'s dtype, the
    state (B, C, 1, 2): a and b of the module docstring after the last token, in fp32)."""
    batch, length, channels = key.shape
    k = key.float().exp()
    v = value.float()
    decay = (-time_decay.float().exp()).view(1, 1, channels).expand(batch, length, channels)
    packed = torch.stack([v, torch.ones_like(v)], dim=-1).reshape(batch, length, 2 * channels)
    out, state = torch.ops.tfgraph.linear_attention(
        torch.ones_like(k), k, packed, None, decay.contiguous(), None, channels, "gated", 1.0
    )
    before = shifted(out).view(batch, length, channels, 2)  # (a, b)_{t−1}
    bonus = k * time_first.float().exp()  # e^{u+k}
    numerator = before[..., 0] + bonus * v
    denominator = before[..., 1] + bonus
    return (numerator / denominator).to(key.dtype), state


def shifted(x: torch.Tensor) -> torch.Tensor:
    """x_{t−1} along the tokens of x (B, T, C), zeros before the first: a causal depthwise
    convolution of width 2 with weights (1, 0), whose carried state is the last token's x."""
    channels = x.shape[-1]
    weight = x.new_tensor([1.0, 0.0]).view(1, 1, 2).expand(channels, 1, 2).contiguous()
    y, _ = torch.ops.tfgraph.causal_conv(x.transpose(1, 2), weight, None, None, "none")
    return y.transpose(1, 2)


def _entry_point(original):
    def rwkv_linear_attention(time_decay, time_first, key, value, state=None, return_state=False):
        if state is not None:
            return original(time_decay, time_first, key, value, state, return_state)
        out, carried = wkv(time_decay, time_first, key, value)
        if not return_state:
            return out, None
        # Hugging Face's (num, den, max) with max 0: num·e^0 is the unnormalized a
        a, b = carried[:, :, 0, 0], carried[:, :, 0, 1]
        return out, [a, b, torch.zeros_like(a)]

    rwkv_linear_attention.__wrapped__ = original
    return rwkv_linear_attention


def _is_entry_point(function) -> bool:
    if not callable(function) or getattr(function, "__name__", None) != ENTRY_POINT:
        return False
    try:
        return tuple(inspect.signature(function).parameters) == ENTRY_PARAMS
    except (TypeError, ValueError):
        return False


def _token_shift(self, hidden: torch.Tensor) -> torch.Tensor:
    return shifted(hidden)


def _is_shift(module: nn.Module, parent: nn.Module) -> bool:
    return (
        isinstance(module, nn.ZeroPad2d)
        and tuple(module.padding) == SHIFT
        and hasattr(parent, "time_mix_key")
    )


@contextlib.contextmanager
def substituted(module: nn.Module) -> Iterator[int]:
    """Within the block, RWKV's ``wkv`` recurrence runs as one op and its token shifts as
    causal convolutions; yields how many token-mixing layers (time and channel mixing)."""
    patched: list[tuple[object, str, object]] = []
    for name in sorted({type(m).__module__ for m in module.modules()}):
        namespace = sys.modules.get(name)
        function = getattr(namespace, ENTRY_POINT, None) if namespace else None
        if _is_entry_point(function):
            patched.append((namespace, ENTRY_POINT, function))
            setattr(namespace, ENTRY_POINT, _entry_point(function))
    shifts = []
    if patched:
        for parent in module.modules():
            shift = getattr(parent, "time_shift", None)
            if isinstance(shift, nn.Module) and _is_shift(shift, parent):
                if "forward" not in vars(shift):
                    shift.forward = types.MethodType(_token_shift, shift)
                    shifts.append(shift)
        logger.info(
            "RWKV wkv traced as linear attention, %d token shifts as convolutions", len(shifts)
        )
    try:
        yield len(shifts)
    finally:
        for shift in shifts:
            del shift.forward
        for namespace, attr, function in reversed(patched):
            setattr(namespace, attr, function)
