"""A mask causal except within a block of marked tokens (Gemma 3's image block at the prompt)
is classified ``prompt_block`` (probed with the id the graph compares the tokens against), kept
non-causal through the KV cache pass and lowered with its bias: cached greedy tokens equal the
eager module's on prompts with and without the block."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import tfgraph
from tfgraph import from_module
from tfgraph.exporters.compile import run_pipeline
from tfgraph.passes.recognize.attention.classify_bias import ClassifyAttentionBiasPass
from tfgraph.passes.recognize.attention.fuse import FuseAttentionPass
from tfgraph.passes.recognize.attention.prompt_block import opens_later_keys
from tfgraph.runtime import CachedDecoder, Session
from tfgraph.sources.trace import trace
from tfgraph.verify.generation_parity import compare_greedy

# the block's token (an image token): the last of a vocabulary large enough that the parity's
# random prompts hold none, so that no block runs on past the prompt into the decoded tokens
# (a block is the step's own: the cache parity's eager pass over prompt + steps would extend it)
VOCAB = 512
MARK = VOCAB - 1
NEG = -1e9


class BlockLM(nn.Module):
    """Two attention layers whose marked tokens see every marked token after them up to the
    row's last one (``key ≤ query + reach``, reach from the step's own ids, as gemma.py): the
    second layer carries what the block saw to the text after it."""

    def __init__(self, block: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = block
        self.embed = nn.Embedding(VOCAB, 32)
        self.qkv = nn.ModuleList(nn.Linear(32, 96, bias=False) for _ in range(2))
        self.out = nn.Linear(32, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from tfgraph.sources.vlm_families.gemma import image_reach

        b, t = input_ids.shape
        x = self.embed(input_ids)
        index = torch.arange(t, device=input_ids.device)
        extra = image_reach(input_ids, MARK, index) if self.block else 0 * input_ids
        visible = index[None, None, :] <= index[None, :, None] + extra[..., None]
        visible = (visible & attention_mask[:, None, :].bool())[:, None]
        for qkv in self.qkv:
            q, k, v = qkv(x).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
            y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)
            x = x + y.transpose(1, 2).reshape(b, t, 32)
        return self.out(x)


def _classified(module: nn.Module) -> list:
    ids = torch.tensor([[1, MARK, MARK, 2, 3]])
    model = trace(from_module(module, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}))
    run_pipeline(model, "cleanup")
    FuseAttentionPass()(model)
    ClassifyAttentionBiasPass()(model)
    return [n for n in model.graph if n.domain == "tfgraph" and n.op_type == "Attention"]


def _causal(t: int) -> np.ndarray:
    return np.where(np.triu(np.ones((t, t), bool), 1), NEG, 0.0)


def test_opens_later_keys_only():
    plain = _causal(5)
    block = plain.copy()
    block[1, 2:4] = 0.0  # query 1 sees keys 2 and 3: its block
    assert opens_later_keys(plain, block)
    assert not opens_later_keys(plain, plain)  # nothing opened
    earlier = plain.copy()
    earlier[3, 0] = NEG  # a key before its query masked: not a block
    assert not opens_later_keys(plain, np.minimum(block, earlier))
    assert not opens_later_keys(block, block)  # the ordinary mask is not causal


def test_block_mask_is_classified_prompt_block_and_kept():
    nodes = _classified(BlockLM())
    assert len(nodes) == 2
    for node in nodes:
        attrs = node.attributes
        assert attrs["bias_kind"].value == "prompt_block" and attrs["causal"].value == 0
        assert len(node.inputs) > 3 and node.inputs[3] is not None  # the bias is kept


def test_plain_causal_mask_is_not_a_block():
    for node in _classified(BlockLM(block=False)):
        assert node.attributes["bias_kind"].value != "prompt_block"
        assert node.attributes["causal"].value == 1


# slow: an export with parity and a cached greedy run (~15 s)
@pytest.mark.slow
@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_block_layer_is_cached_and_generates_like_eager(tmp_path, target):
    ids = torch.tensor([[1, MARK, 2]])
    source = from_module(BlockLM(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    result = tfgraph.export(source, tmp_path / "m", kv_cache=True, target=target)
    assert result.passed and result.report["kv_cache"]
    decoder = CachedDecoder(Session(tmp_path / "m"))
    prompts = [[1, MARK, MARK, MARK, 2, 3], [4, MARK, MARK, 5], [1, 2, 3]]
    comparison = compare_greedy(source, decoder, prompts, 8)
    assert comparison.passed, comparison.steps
