"""Dynamic dims that a model's Python code specialized to the example's size, and the trace
substitutions that keep them dynamic: host-side ranges of a traced length (CPM-Ant's
``torch.tensor(list(range(n))[::-1])``, :mod:`tfgraph.sources.host_ranges`) and the RG-LRU's
Python loop over the tokens (RecurrentGemma, :mod:`tfgraph.sources.rg_lru`). Before either,
torch.export failed with "Found the following conflicts between user-specified ranges and
inferred ranges" (``input_ids.shape[1]`` static)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tfgraph
from tfgraph.sources import from_module, host_ranges, rg_lru


class ReversedRangeMask(nn.Module):
    """CPM-Ant's left-padding mask, reduced: a tensor built from a Python list whose length is
    the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32)

    def distances(self, input_ids: torch.Tensor) -> torch.Tensor:
        seqlen = input_ids.size(1)
        device = input_ids.device
        back = torch.tensor(list(range(seqlen))[::-1], device=device)[None, :]
        ahead = torch.tensor(list(range(1, seqlen + 1)), device=device)[None, :]
        return back.repeat(input_ids.size(0), 1) * ahead

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.distances(input_ids).float()[..., None] / 64.0
        return self.head(self.embed(input_ids) * weight)


def _traced_length(module: nn.Module, length: int = 9) -> None:
    ids = torch.randint(0, 32, (2, length))
    dims = ({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC},)
    torch.export.export(module, (ids,), dynamic_shapes=dims, strict=False)


def test_a_host_range_specializes_the_sequence_without_the_substitution():
    with pytest.raises(Exception, match="inferred ranges|specialized"):
        _traced_length(ReversedRangeMask().eval())


def test_host_ranges_are_rewritten_to_arange_and_restored():
    model = ReversedRangeMask().eval()
    original = ReversedRangeMask.distances
    copy = host_ranges.rewritten(original)
    assert copy is not None and host_ranges.rewritten(ReversedRangeMask.forward) is None
    ids = torch.randint(0, 32, (3, 11))
    torch.testing.assert_close(copy(model, ids), original(model, ids), rtol=0, atol=0)
    assert copy(model, ids).dtype == original(model, ids).dtype == torch.int64
    with host_ranges.substituted(model) as taken:
        assert taken == 1 and ReversedRangeMask.distances is not original
        _traced_length(model)  # the sequence stays dynamic
    assert ReversedRangeMask.distances is original


def test_host_range_model_exports_with_a_dynamic_sequence(tmp_path):
    torch.manual_seed(0)
    source = from_module(ReversedRangeMask(), origin="test:reversed-range")
    result = tfgraph.export(source, tmp_path / "art")
    assert result.report["parity"]["passed"], result.report["parity"]["outputs"]
    assert source.info["host_ranges"] == 1


def _rglru():
    from transformers import RecurrentGemmaConfig
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    config = RecurrentGemmaConfig(hidden_size=32, lru_width=32, num_attention_heads=4)
    torch.manual_seed(0)
    layer = RecurrentGemmaRglru(config).eval()
    for p in layer.parameters():
        nn.init.normal_(p, std=0.3)
    return layer


class RgLruLM(nn.Module):
    """Embedding → RG-LRU → head; the RG-LRU's state is reset per call (as Hugging Face's
    model does when it sets up its cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.rg_lru = _rglru()
        self.head = nn.Linear(32, 64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.rg_lru.recurrent_states = None
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)[None].expand(batch, length)
        return self.head(self.rg_lru(self.embed(input_ids), positions))


def test_rg_lru_scan_computes_the_python_loop():
    layer = _rglru()
    torch.manual_seed(1)
    x, gate = torch.randn(2, 10, 32), torch.rand(2, 10, 32) * 0.9 + 0.05
    reset = torch.zeros(2, 10, 1, dtype=torch.bool)
    reset[:, 0] = True
    reset[1, 4] = True  # a document starting mid-row (a left-padded row's first token)
    want, want_state = layer._rnn_scan(x, gate, reset, None)
    got, state = rg_lru.scan(x, gate, reset)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(state, want_state)


def test_rg_lru_traces_with_a_dynamic_sequence(tmp_path):
    model = RgLruLM().eval()
    with pytest.raises(Exception, match="inferred ranges|specialized"):
        _traced_length(model)  # the Python loop over the tokens, unrolled
    source = from_module(model, origin="test:rg-lru")
    result = tfgraph.export(source, tmp_path / "art")
    assert result.report["parity"]["passed"], result.report["parity"]["outputs"]
    recurrent = result.report["fusions"]["recurrent"]
    assert recurrent["fused"] == recurrent["total"] == 1, recurrent
    assert "_rnn_scan" not in vars(model.rg_lru)  # eager code restored


def test_recurrent_block_conv_is_the_causal_conv_op():
    from transformers import RecurrentGemmaConfig
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import (
        RecurrentGemmaRecurrentBlock,
    )

    config = RecurrentGemmaConfig(hidden_size=32, lru_width=32, num_attention_heads=4)
    torch.manual_seed(0)
    block = RecurrentGemmaRecurrentBlock(config, 0).eval()
    with torch.no_grad():  # a bare block keeps torch.empty parameters (the model inits them)
        for p in block.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(2, 9, 32)
    positions = torch.arange(9)[None].expand(2, 9)
    with torch.no_grad():
        want, _ = block(x, positions, None, use_cache=False)
        with rg_lru.substituted(block) as taken:
            assert taken == 1 and "forward" in vars(block)
            got, _ = block(x, positions, None, use_cache=False)
    assert "forward" not in vars(block)
    torch.testing.assert_close(got, want)
