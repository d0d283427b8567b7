"""xLSTM's mLSTM cell traced as one ``tfgraph::linear_attention`` per layer.

Hugging Face's ``xLSTMBackend`` (modeling_xlstm.py, when the ``xlstm`` package is absent) runs
the chunkwise kernel on ``T // 64`` chunks and a Python loop of recurrent steps on the
``T % 64`` tokens left over: torch.export specializes the sequence to the example's length. A
step of that loop, per head, with ``q`` scaled by ``d_k^{-1/2}``, is

    m_t = max(log σ(f_t) + m_{t−1}, i_t)
    C_t = e^{log σ(f_t) + m_{t−1} − m_t}·C_{t−1} + e^{i_t − m_t}·k_t v_tᵀ      (n_t: v_t = 1)
    h_t = C_tᵀ q_t / (max(|n_t·q_t|, e^{−m_t}) + ε)

(the chunkwise kernel computes the same ``m`` and the same ratio). ``m`` only stabilizes: with
``C̃_t = e^{m_t}·C_t`` (and ñ) the recurrence is the ``gated`` rule of
:func:`tfgraph.sources.recurrent_kernels.linear_attention` with decay ``log σ(f_t)``, key
``e^{i_t}·k_t``, and ``h_t = C̃_tᵀ q_t / (max(|ñ_t·q_t|, 1) + ε·e^{m_t})``. The normalizer is a
column of ones appended to each head's values (d_v + 1 columns), so one op carries both. The
keys are scaled by ``e^{i_t − c}`` with ``c`` the gate soft cap (15 by default; 0 without one)
and the 1 of the maximum becomes ``e^{−c}``: with a soft cap ``e^{i − c} ≤ 1`` never
overflows, and what underflows weighs below ``e^{−87}`` against a denominator of at least
``e^{−c}``. The computation is in fp32 whatever the model's dtype (Hugging Face's state dtype
is fp32 too).

Not exact: ε. Hugging Face adds ``ε = config.eps`` (1e-6) to the stabilized denominator, that
is ``ε·e^{m_t}`` to the unstabilized one, and ``m_t`` is a running maximum that no linear
recurrence carries. Here ``ε`` is added as if ``m_t = 0`` (as it is at the first token from a
zero state). The relative difference is at most ``ε·|e^{m_t} − 1| / max(|ñ_t·q_t|, 1)``:
below 1e-6 while ``m_t ≤ 0`` (input-gate pre-activations ≤ 0, the initialization's −10),
up to ``1e-6·e^{15} ≈ 3`` where input gates near the soft cap of 15 meet a near-zero
normalizer ``|ñ·q|`` (measured on random gates biased to 12–15: 0.5–0.7 off Hugging Face's
fp64 result on outputs of magnitude 1500–1800, where its own fp32 loop is 0.05–0.25 off).

Without a soft cap ``e^{i}`` overflows fp32 for input gates above about 88 − ln(window).

A backend is recognized by what it holds (``chunkwise_kernel_fn``, ``sequence_kernel_fn``,
``step_kernel_fn``, a config with ``eps`` and ``mode``); with an initial state (Hugging Face's
cached decoding, never while tracing) the original runs. The state it returns is Hugging
Face's (C, n, m) with m = c.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tfgraph.sources import recurrent_kernels  # noqa: F401 - registers tfgraph::linear_attention
from tfgraph.sources.instance_methods import instance_methods

logger = logging.getLogger(__name__)

BACKEND_PARTS = ("chunkwise_kernel_fn", "sequence_kernel_fn", "step_kernel_fn", "config")


def mlstm(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    igate: torch.Tensor,
    fgate: torch.Tensor,
    eps: float = 1e-6,
    shift: float = 0.0,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The mLSTM from a zero state: (h (B, H, T, d_v) in ``query``'s dtype, Hugging Face's
    last (C (B, H, d_k, d_v), n (B, H, d_k), m (B, H, 1)) in fp32, stabilized by m = shift).
    q, k (B, H, T, d_k), v (B, H, T, d_v), gate pre-activations (B, H, T)."""
    numerator, normalizer, state = unnormalized(query, key, value, igate, fgate, shift)
    floor = math.exp(-shift)  # the 1 of max(|ñ·q|, 1), scaled by e^{−c}
    denominator = normalizer.abs().clamp_min(floor) + eps * floor
    h = (numerator / denominator).to(query.dtype)
    dv = value.shape[-1]
    last = (state[..., :dv], state[..., dv], state.new_full(state.shape[:2] + (1,), shift))
    return h, last


def unnormalized(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    igate: torch.Tensor,
    fgate: torch.Tensor,
    shift: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(C̃ᵀq (B, H, T, d_v), ñ·q (B, H, T, 1), the op's state (B, H, d_k, d_v + 1)), C̃ and ñ
    scaled by e^{−shift}, q by d_k^{−1/2}; fp32."""
    batch, heads, length, dk = query.shape
    dv = value.shape[-1]

    def packed(x: torch.Tensor) -> torch.Tensor:  # (B, H, T, d) → (B, T, H·d)
        return x.transpose(1, 2).reshape(batch, length, heads * x.shape[-1])

    gain = torch.exp(igate.float() - shift).unsqueeze(-1)  # e^{i − c}
    v = value.float()
    out, state = torch.ops.tfgraph.linear_attention(
        packed(query.float()),
        packed(key.float() * gain),
        packed(torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)),
        None,
        F.logsigmoid(fgate.float()).transpose(1, 2).contiguous(),
        None,
        heads,
        "gated",
        dk**-0.5,
    )
    out = out.view(batch, length, heads, dv + 1).transpose(1, 2)
    return out[..., :dv], out[..., dv:], state


def _shift(config) -> float:
    cap = getattr(config, "gate_soft_cap", None)
    return float(cap) if cap is not None else 0.0


def _backend_forward(original):
    def forward(
        self,
        query,
        key,
        value,
        igate,
        fgate,
        c_initial=None,
        n_initial=None,
        m_initial=None,
        return_last_states=None,
        mode=None,
    ):
        if c_initial is not None or n_initial is not None or m_initial is not None:
            return original(
                query, key, value, igate, fgate, c_initial, n_initial, m_initial,
                return_last_states, mode,
            )  # fmt: skip
        config = self.config
        h, last = mlstm(query, key, value, igate, fgate, config.eps, _shift(config))
        mode = config.mode if mode is None else mode
        if "train" in mode:
            if return_last_states is None:
                return_last_states = config.return_last_states
            if not return_last_states:
                return h
        return h, last

    forward.__wrapped__ = original
    return forward


def is_backend(module: torch.nn.Module) -> bool:
    if not all(hasattr(module, p) for p in BACKEND_PARTS):
        return False
    config = module.config
    return all(hasattr(config, a) for a in ("eps", "mode", "chunk_size"))


@contextlib.contextmanager
def substituted(module: torch.nn.Module) -> Iterator[int]:
    """Within the block, each mLSTM backend of ``module`` runs its recurrence as one op;
    yields how many layers."""
    with instance_methods(module, "forward", is_backend, _backend_forward) as taken:
        if taken:
            logger.info("mLSTM cells traced as linear attention: %d layers", len(taken))
        yield len(taken)
