"""Attention over keys joined inside the softmax and a softmax that is not attention.

PEGASUS-X's block-local attention scores each block's queries against the global tokens' keys
and against its own block's keys, joins both for one softmax and splits the probabilities
again (:mod:`tfgraph.passes.recognize.attention.concat_keys`): it must fuse into one
``tfgraph.Attention`` over the concatenated keys and values, heads kept, and keep parity with
eager PyTorch (the parity check's default tolerance, atol 1e-4). Granite Speech 5's
self-conditioned CTC posteriors, ``softmax(h · W_ctcᵀ)`` with the CTC head's tied weight, are
not attention: not fused, not counted, not reported missed.
"""

import onnx_ir as ir
import pytest
import torch
from onnxscript.rewriter import RewriteRuleSet
from torch import nn

import tfgraph.passes.recognize.attention.concat_keys as concat_keys_rules
import tfgraph.passes.recognize.attention.einsum as einsum_rules
from tests.passes.recognize.attention.test_attention_rules_more import (  # noqa: E402
    D,
    H,
    _attention,
    _Heads,
    _proven,
)
from tfgraph import from_module
from tfgraph.exporters.compile import run_pipeline
from tfgraph.passes.recognize.attention.einsum import broadcast_batched_matmul
from tfgraph.passes.recognize.attention.fuse import FuseAttentionPass, is_gating_softmax
from tfgraph.passes.rewrite_utils import apply_rules, diagnose
from tfgraph.sources.trace import trace

G, BLOCK = 3, 4  # global tokens, block size


class BlockLocal(_Heads):
    """``PegasusXGlobalLocalAttention.compute_local_attention_representations``: Q scaled,
    (B, H, blocks, block, d) blocks, scores against the global keys (one set for every block)
    and the block's own keys joined, the padded mask added, probabilities split for the
    global and the block values. ``swap``: the two products summed the other way round;
    ``masked``: the padding mask; ``per_head``: a mask that differs per head."""

    input_names = ("q", "k", "v", "global_k", "global_v", "attention_mask")

    def __init__(self, masked: bool = True, swap: bool = False, per_head: bool = False) -> None:
        super().__init__()
        self.masked, self.swap, self.per_head = masked, swap, per_head
        self.head_bias = nn.Parameter(torch.randn(H, 1, 1) if per_head else torch.zeros(1))

    def example_inputs(self, batch, seq, generator):
        inputs = {n: torch.randn(batch, H, seq, D, generator=generator) for n in "qkv"}
        for n in ("global_k", "global_v"):
            inputs[n] = torch.randn(batch, H, G, D, generator=generator)
        mask = torch.zeros(batch, seq)
        mask[0, -2:] = torch.finfo(torch.float32).min  # a padded sample
        return {**inputs, "attention_mask": mask}

    def dynamic_axes(self):
        axes = {n: {0: "batch", 2: "sequence"} for n in "qkv"}
        axes.update({n: {0: "batch"} for n in ("global_k", "global_v")})
        return {**axes, "attention_mask": {0: "batch", 1: "sequence"}}

    def forward(self, q, k, v, global_k, global_v, attention_mask):
        b, h, t, d = q.shape
        extra = -t % BLOCK  # padded to whole blocks, the padding masked (as PEGASUS-X does)
        q, k, v = (nn.functional.pad(x, (0, 0, 0, extra)) for x in (q, k, v))
        fill = torch.finfo(q.dtype).min
        attention_mask = nn.functional.pad(attention_mask, (0, extra), value=fill)
        n = (t + extra) // BLOCK
        q5, k5, v5 = (x.view(b, h, n, BLOCK, d) for x in (q * d**-0.5, k, v))
        l2g = torch.einsum("BHNKF,BHGF->BHNKG", q5, global_k)
        l2l = torch.einsum("BHNKF,BHNXF->BHNKX", q5, k5)
        w = torch.cat([l2g, l2l], dim=-1)
        if self.masked:
            mask = nn.functional.pad(attention_mask.view(b, n, BLOCK), pad=(G, 0), value=0)
            mask = mask[:, None, :, None, :]
            w = w + (mask + self.head_bias[:, :, None] if self.per_head else mask)
        p = torch.softmax(w, dim=-1)
        to_global = torch.einsum("BHNKG,BHGF->BHNKF", p[..., :G], global_v)
        to_block = torch.einsum("BHNKX,BHNXF->BHNKF", p[..., G:], v5)
        y = to_block + to_global if self.swap else to_global + to_block
        return y.reshape(b, h, t + extra, d)[:, :, :t]


def _fused(module):
    model = trace(from_module(module))
    run_pipeline(model, "cleanup")
    FuseAttentionPass()(model)
    return model


@pytest.mark.parametrize(
    "masked, swap",
    [
        (True, False),
        # slow: 14 s; the swapped operand order of the masked block, (False, False) stays
        pytest.param(True, True, marks=pytest.mark.slow),
        (False, False),
    ],
)
def test_block_local_attention_fuses_with_its_heads(masked, swap, tmp_path):
    module = BlockLocal(masked=masked, swap=swap)
    (node,) = _attention(_fused(module))
    assert node.attributes["num_heads"].value == H  # blocks merged into the batch, heads kept
    assert node.attributes["scale"].value == 1.0  # Q is scaled before its block view
    assert len(node.inputs) == (4 if masked else 3)
    if masked:  # the mask is (B·blocks, 1, 1, G + block): not expanded over heads and queries
        assert list(node.inputs[3].shape)[1:] == [1, 1, G + BLOCK]
    result = _proven(module, tmp_path)  # fused == total == 1, parity (atol 1e-4)
    assert "Einsum" not in result["ops"] and "Softmax" not in result["ops"]


def test_a_mask_that_differs_per_head_is_rejected():
    """The heads cannot be kept apart from the merged blocks when the mask varies along them."""
    model = trace(from_module(BlockLocal(per_head=True)))
    run_pipeline(model, "cleanup")
    apply_rules(model, RewriteRuleSet(einsum_rules.EINSUM_RULES))
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    reason = diagnose(model, concat_keys_rules.CONCAT_KEYS_RULES, softmax, depth=3)
    assert "no static head axis" in reason


@pytest.mark.parametrize(
    "equation, expected",
    [
        ("BHNKF,BHGF->BHNKG", ([], [2], ([0, 1, 2, 3, 4], [0, 1, 2, 4, 3], [0, 1, 2, 3, 4]))),
        ("BHNKG,BHGF->BHNKF", ([], [2], ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]))),
        ("BHNKF,BHNXF->BHNKX", None),  # nothing missing: parse_batched_matmul's case
        ("bhud,uvhd->bhuv", None),  # Shaw's relative term stays an einsum
        ("bhlk,bhlk->bhl", None),
    ],
)
def test_broadcast_operand_equations(equation, expected):
    assert broadcast_batched_matmul(equation) == expected


class SelfConditionedCtc(nn.Module):
    """An attention layer, then Granite Speech 5's self-conditioned CTC: the posteriors of a
    CTC head whose weight is tied to the final head's fed back through a projection."""

    input_names = ("x",)
    output_names = ("logits",)
    VOCAB = 12

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.out = nn.Linear(H * D, self.VOCAB)
        self.out_mid = nn.Linear(self.VOCAB, H * D)
        self.head = nn.Linear(H * D, self.VOCAB)
        self.head.weight = self.out.weight  # tied: exported as Transpose(W), not a constant

    def example_inputs(self, batch, seq, generator):
        return {"x": torch.randn(batch, seq, H * D, generator=generator)}

    def dynamic_axes(self):
        return {"x": {0: "batch", 1: "sequence"}}

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, H, D).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1))
        w = torch.softmax(q @ k.transpose(-1, -2) * D**-0.5, dim=-1)
        h = x + (w @ v).transpose(1, 2).reshape(b, t, H * D)
        h = h + self.out_mid(torch.softmax(self.out(h), dim=-1))
        return self.head(h)


def test_self_conditioned_ctc_posteriors_are_not_attention(tmp_path):
    model = _fused(SelfConditionedCtc())
    (ctc,) = (n for n in model.graph if n.op_type == "Softmax")
    assert is_gating_softmax(ctc)
    _proven(SelfConditionedCtc(), tmp_path)  # 1 of 1 attention fused, parity


def test_a_transposed_constant_weight_makes_a_gate():
    """The tied weight as ``Transpose(W)``; a weight computed from an activation is no gate."""
    model = ir.from_onnx_text("""
    <ir_version: 10, opset_import: ["" : 20]>
    g (float[2, sequence, 8] x, float[4, 8] a) => (float[2, sequence, 4] p,
                                                    float[2, sequence, 4] r) {
        w = Constant <value = float[4, 8] {1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
            1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
            1.0, 1.0, 1.0, 1.0}> ()
        wt = Transpose <perm: ints = [1, 0]> (w)
        logits = MatMul (x, wt)
        p = Softmax <axis: int = -1> (logits)
        at = Transpose <perm: ints = [1, 0]> (a)
        scores = MatMul (x, at)
        r = Softmax <axis: int = -1> (scores)
    }
    """)
    ir.passes.common.ShapeInferencePass()(model)
    tied, activation = (n for n in model.graph if n.op_type == "Softmax")
    assert is_gating_softmax(tied)
    assert not is_gating_softmax(activation)
