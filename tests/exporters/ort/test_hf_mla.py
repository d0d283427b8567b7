"""Multi-head latent attention (DeepSeek V3): V heads narrower than Q/K's (16 against 32).

ONNX Runtime's GroupQueryAttention takes one head size for all three and refused it at run
time ("INVALID_ARGUMENT … GroupQueryAttention"), and the KV cache gave V's past K's head size
("Can't merge shape info … Inferred=16 Declared=32"). The ``ort`` target now lowers it to
MultiHeadAttention, each past takes its own head size, and the cached export passes prefill
and decode parity and generates like eager."""

import onnx_ir as ir
import pytest

import tfgraph
from tfgraph.runtime import CachedDecoder, Session
from tfgraph.sources import load_source
from tfgraph.tools.coverage import tiny_config
from tfgraph.verify.generation_parity import compare_greedy

transformers = pytest.importorskip("transformers")


# slow: 1.3 min on a DeepSeek-V3 MLA model (architecture coverage)
@pytest.mark.slow
def test_narrower_value_heads_are_cached(tmp_path):
    config = tiny_config("deepseek_v3", "causal-lm")
    assert config.qk_nope_head_dim + config.qk_rope_head_dim != config.v_head_dim
    transformers.DeepseekV3ForCausalLM(config).eval().save_pretrained(tmp_path / "hf")
    result = tfgraph.export(str(tmp_path / "hf"), tmp_path / "art", kv_cache=True)
    parity = result.report["parity"]
    assert parity["prefill"]["passed"] and parity["decode"]["passed"]
    attention = result.report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == 2
    model = ir.load(tmp_path / "art" / "model.onnx")
    ops = {n.op_type for n in model.graph}
    assert "MultiHeadAttention" in ops and "GroupQueryAttention" not in ops
    shapes = {
        v.name: [d if isinstance(d, int) else str(d) for d in v.shape] for v in model.graph.inputs
    }
    assert shapes["past_key_values.0.key"][3] == 32 and shapes["past_key_values.0.value"][3] == 16
    decoder = CachedDecoder(Session(tmp_path / "art"))
    source = load_source(str(tmp_path / "hf"))
    assert compare_greedy(source, decoder, [[5, 9, 2, 7], [3, 1]], 8).passed
