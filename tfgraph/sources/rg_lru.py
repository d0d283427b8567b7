"""RG-LRU recurrences (Griffin, RecurrentGemma) traced as one ``tfgraph::linear_attention``.

The Real-Gated Linear Recurrent Unit is a diagonal, per-channel gated linear recurrence,
``h_t = a_t ⊙ h_{t−1} + x̂_t`` (``x̂_t`` the gated, normalized input; ``a_t = 0`` where a
document starts). Hugging Face's ``_rnn_scan`` loops over the tokens in Python: torch.export
specializes the sequence to the example's length ("Found the following conflicts between
user-specified ranges and inferred ranges").

It is the ``gated`` rule of :func:`tfgraph.sources.recurrent_kernels.linear_attention` with one
head per channel and d_k = d_v = 1 (as Mamba-1's selective scan is stated): ``q = k = 1``,
``v = x̂``, decay ``log a_t`` (a reset: a decay of −10⁴, whose ``exp`` is 0 in fp32, finite
so that a chunked kernel's cumulative sums stay finite). While tracing, ``_rnn_scan`` of a
layer recognized by what it holds (``_rnn_scan``, ``recurrent_param``, ``input_gate_weight``,
``recurrent_gate_weight``) is stated with the op; with a recurrent state or one token (decode,
never while tracing) the original runs.

Griffin's recurrent block convolves before the RG-LRU with an ``nn.Conv1d`` padded by
``K − 1`` on both sides and cut to the input's length: a causal depthwise convolution, stated
while tracing as ``tfgraph::causal_conv`` (no activation), so that the cache pass carries its
``K − 1`` last inputs as it does Mamba's. A block is recognized by ``conv_1d``, ``rg_lru``,
``linear_x``, ``linear_y`` and ``linear_out``; with ``use_cache`` its original ``forward`` runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from tfgraph.sources import recurrent_kernels  # noqa: F401 - registers tfgraph::linear_attention
from tfgraph.sources.instance_methods import instance_methods

logger = logging.getLogger(__name__)

RG_LRU_PARTS = ("_rnn_scan", "recurrent_param", "input_gate_weight", "recurrent_gate_weight")
RESET_DECAY = -1.0e4  # exp() is 0 in fp32 and fp16: the state before a reset is dropped


BLOCK_PARTS = ("conv_1d", "rg_lru", "linear_x", "linear_y", "linear_out", "act_fn")


def _is_block(module: torch.nn.Module) -> bool:
    if not all(hasattr(module, p) for p in BLOCK_PARTS):
        return False
    conv = module.conv_1d
    width = conv.kernel_size[0] if isinstance(conv, torch.nn.Conv1d) else 0
    return (
        width > 0
        and conv.groups == conv.in_channels == conv.out_channels
        and conv.padding == (width - 1,)
        and conv.stride == (1,)
        and conv.dilation == (1,)
    )


def _block_forward(original):
    def forward(self, input_states, position_ids, attention_mask, use_cache=True, **kwargs):
        if use_cache:
            return original(input_states, position_ids, attention_mask, use_cache, **kwargs)
        y_branch = self.act_fn(self.linear_y(input_states))
        x_branch = self.linear_x(input_states).transpose(1, 2)
        conv = self.conv_1d
        x_branch, _ = torch.ops.tfgraph.causal_conv(x_branch, conv.weight, conv.bias, None, "none")
        self.rg_lru.recurrent_states = None
        x_branch = self.rg_lru(x_branch.transpose(1, 2), position_ids)
        return self.linear_out(x_branch * y_branch), None

    return forward


def is_rg_lru(module: torch.nn.Module) -> bool:
    return all(hasattr(module, p) for p in RG_LRU_PARTS)


def scan(
    hidden_states: torch.Tensor,
    recurrent_gate: torch.Tensor,
    reset: torch.Tensor,
    acc_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_rnn_scan`` from a zero state: (h for every token, h after the last), h as
    ``hidden_states`` (B, T, C), the state (B, C) in ``acc_dtype``."""
    batch, _, channels = hidden_states.shape
    x = hidden_states.to(acc_dtype)
    log_gate = torch.log(recurrent_gate.to(acc_dtype))
    decay = torch.where(reset, torch.full_like(log_gate, RESET_DECAY), log_gate)
    ones = torch.ones_like(x)
    out, state = torch.ops.tfgraph.linear_attention(
        ones, ones, x, None, decay.contiguous(), None, channels, "gated", 1.0
    )
    return out.to(hidden_states.dtype), state.reshape(batch, channels)


def _scan_method(original):
    def _rnn_scan(
        self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=torch.float32
    ):
        if recurrent_states is not None or hidden_states.shape[1] == 1:
            return original(hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)
        return scan(hidden_states, recurrent_gate, reset, acc_dtype)

    return _rnn_scan


@contextlib.contextmanager
def substituted(module: torch.nn.Module) -> Iterator[int]:
    """Within the block, each RG-LRU of ``module`` runs its recurrence as one op; yields how
    many layers."""
    with (
        instance_methods(module, "_rnn_scan", is_rg_lru, _scan_method) as taken,
        instance_methods(module, "forward", _is_block, _block_forward),
    ):
        if taken:
            logger.info("RG-LRU recurrences traced as linear attention: %d layers", len(taken))
        yield len(taken)
