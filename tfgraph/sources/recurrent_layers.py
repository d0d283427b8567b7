"""Recurrent layers whose recurrence is written inside the layer's own ``forward``: the layer
traced with one ``tfgraph::linear_attention`` op in place of its Python loop.

:mod:`.recurrent_kernels` takes over named kernel entry points; some layers have none and loop
in ``forward`` itself. MiniMax's lightning attention loops over blocks of ``block_size``
tokens (256): torch.export unrolls the loop for the example's length, so the traced graph is
wrong for a longer input, silently. Its recurrence is the ``gated`` rule with a constant decay
per head, ``S_t = exp(−λ_h)·S_{t−1} + k_t v_tᵀ``, ``o_t = q_t S_t`` (the block form computes
exactly this), so while tracing the layer's ``forward`` is replaced by the same computation
stated with the op. A layer is recognized by what it holds and calls (``slope_rate``,
``qkv_proj``, ``output_gate``, ``norm``, ``out_proj``, ``block_size``), not by architecture
name; called with a cache (never while tracing), the original ``forward`` runs.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tfgraph.sources import recurrent_kernels  # noqa: F401 - registers tfgraph::linear_attention
from tfgraph.sources.instance_methods import instance_methods

logger = logging.getLogger(__name__)

LIGHTNING_PARTS = ("slope_rate", "qkv_proj", "output_gate", "norm", "out_proj", "block_size")


def _is_lightning(module: torch.nn.Module) -> bool:
    own = sys.modules.get(type(module).__module__)
    parts = all(hasattr(module, p) for p in (*LIGHTNING_PARTS, "act_fn"))
    return parts and hasattr(own, "apply_mask_to_padding_states")


def _lightning_forward(original):
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            return original(hidden_states, position_embeddings, attention_mask, **kwargs)
        own = sys.modules[type(self).__module__]  # the layer's modeling module

        batch, length, _ = hidden_states.shape
        heads, size = self.num_attention_heads, self.head_dim
        qkv = self.act_fn(self.qkv_proj(hidden_states))
        qkv = own.apply_mask_to_padding_states(qkv, attention_mask)
        qkv = qkv.reshape(batch, length, heads, 3 * size)
        q, k, v = (t.reshape(batch, length, heads * size) for t in torch.split(qkv, size, dim=3))
        decay = (-self.slope_rate.view(1, 1, heads)).to(q.dtype).expand(batch, length, heads)
        out, state = torch.ops.tfgraph.linear_attention(
            q, k, v, None, decay.contiguous(), None, heads, "gated", 1.0
        )
        out = self.norm(out)
        out = F.sigmoid(self.output_gate(hidden_states)) * out
        return self.out_proj(out), state

    return forward


@contextlib.contextmanager
def substituted(module: torch.nn.Module) -> Iterator[int]:
    """Within the block, each lightning-attention layer of ``module`` runs its recurrence as
    one op; yields how many layers."""
    with instance_methods(module, "forward", _is_lightning, _lightning_forward) as taken:
        if taken:
            logger.info("lightning attention traced as linear attention: %d layers", len(taken))
        yield len(taken)
