"""Positions counted from the token ids (M2M100, NLLB-MoE, Speech2Text, SeamlessM4T:
``cumsum(ids != pad)``) under a KV cache: the count continues from the past length, as Hugging
Face's own cached forward counts it; a cumulative sum of anything else stays refused
(``test_idioms.test_token_mixing_outside_attention_refuses_the_kv_cache``)."""

from __future__ import annotations

import idiom_models
import onnx_ir as ir
import torch

import tfgraph
from tfgraph.runtime import CachedDecoder, Session
from tfgraph.sources import from_module
from tfgraph.verify.generation_parity import compare_greedy

PROMPTS = [[5, 9, 2, 7, 3], [3, 4, 8, 8, 6]]


def test_counted_positions_continue_from_the_past(tmp_path):
    model = idiom_models.counted_pos_gpt()
    example = {"idx": torch.randint(2, 64, (2, 9))}  # real tokens: never the pad id 1
    source = from_module(model, example, origin="idiom:counted_pos_gpt")
    result = tfgraph.export(source, tmp_path / "art", kv_cache=True)
    parity = result.report["parity"]
    assert parity["prefill"]["passed"] and parity["decode"]["passed"], parity["outputs"]
    assert parity["decode"]["max_abs_err"] < 1e-4
    attention = result.report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == 2
    graph = ir.load(tmp_path / "art" / "model.onnx").graph
    counts = [n for n in graph if n.op_type == "CumSum"]
    assert len(counts) == 1
    (use,) = counts[0].outputs[0].uses()
    assert use.node.op_type == "Add"  # + the past length, before the mask multiplies
    decoder = CachedDecoder(Session(tmp_path / "art"))
    comparison = compare_greedy(source, decoder, PROMPTS, 12)
    assert comparison.passed, (comparison.tokens, comparison.want_tokens)
