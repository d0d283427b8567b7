"""A bias computed from the tokens that reads per-token values along the key axis: DeepSeek's
sparse attention (DSA) selects each query's keys with an indexer, ``TopK`` of ``q_idx·k_idx``
scattered into a mask inside the causal one. The layer is stated causal
(:mod:`passes.causal_within`), and the indexer keys are cached beside K and V
(:mod:`passes.token_value_cache`), as Hugging Face keeps them (``cache.update_indexer``)."""

from __future__ import annotations

import onnx_ir as ir
import pytest

import tfgraph
from tfgraph import contract
from tfgraph.passes.recognize.attention.causal_within import mask_candidates
from tfgraph.runtime import CachedDecoder, Session
from tfgraph.sources import load_source
from tfgraph.tools.coverage import tiny_config
from tfgraph.verify.generation_parity import compare_greedy

transformers = pytest.importorskip("transformers")


# slow: 1 min on an indexer model (architecture coverage); the mask-candidate tests stay
@pytest.mark.slow
def test_indexer_keys_are_cached_and_select_as_eager(tmp_path):
    config = tiny_config("deepseek_v32", "causal-lm")
    config.index_topk = 3  # fewer keys than the prompts: the selection decides the output
    transformers.DeepseekV32ForCausalLM(config).eval().save_pretrained(tmp_path / "hf")
    result = tfgraph.export(str(tmp_path / "hf"), tmp_path / "art", kv_cache=True)
    parity = result.report["parity"]
    assert parity["prefill"]["passed"] and parity["decode"]["passed"], parity["outputs"]
    assert parity["decode"]["max_abs_err"] < 1e-4
    attention = result.report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == 2
    model = ir.load(tmp_path / "art" / "model.onnx")
    roles = contract.read_roles(model.metadata_props)
    pasts = sorted(n for n, (r, _) in roles.items() if r == contract.PAST_TOKENS)
    presents = sorted(n for n, (r, _) in roles.items() if r == contract.PRESENT_TOKENS)
    assert pasts == ["past_token_values.0", "past_token_values.1"]
    assert presents == ["present_token_values.0", "present_token_values.1"]
    shape = next(v.shape for v in model.graph.inputs if v.name == pasts[0])
    assert [d if isinstance(d, int) else str(d) for d in shape] == [
        "batch",
        1,
        contract.PAST_DIM,
        config.index_head_dim,
    ]
    assert sum(n.op_type == "TopK" for n in model.graph) == 2
    decoder = CachedDecoder(Session(tmp_path / "art"))
    source = load_source(str(tmp_path / "hf"))
    prompts = [[5, 9, 2, 7, 3, 8, 4], [3, 1, 6, 6, 2]]
    comparison = compare_greedy(source, decoder, prompts, 10)
    assert comparison.passed, (comparison.tokens, comparison.want_tokens)


def _graph(text: str) -> ir.Graph:
    return ir.from_onnx_text(text).graph


def test_mask_candidates_find_the_causal_mask_inside():
    graph = _graph(
        """
        <ir_version: 10, opset_import: ["" : 20]>
        g (bool[4,4] causal, bool[4,4] picked, float[4,4] scores) => (float[4,4] a, float[4,4] b)
        <float zero = {0.0}, float neg = {-3.0e38}, float small = {-1.0}> {
            keep = And(causal, picked)
            a = Where(keep, zero, neg)
            b = Where(picked, small, scores)
        }
        """
    )
    a, b = graph.outputs
    found = mask_candidates(a)
    assert [(v.name, kind) for v, kind in found] == [("causal", "keep"), ("picked", "keep")]
    # a fill of -1 masks nothing: no part of ``b`` is known to stay masked
    assert mask_candidates(b) == []


def test_masked_fill_keeps_the_masked_operand():
    graph = _graph(
        """
        <ir_version: 10, opset_import: ["" : 20]>
        g (bool[4,4] picked, float[4,4] causal_bias, float[4,4] rel) => (float[4,4] out)
        <float neg = {-3.0e38}> {
            biased = Add(causal_bias, rel)
            out = Where(picked, neg, biased)
        }
        """
    )
    names = [(v.name, kind) for v, kind in mask_candidates(graph.outputs[0])]
    assert names[:2] == [("picked", "fill"), ("biased", "bias")]
    assert ("causal_bias", "bias") in names and ("rel", "bias") in names
