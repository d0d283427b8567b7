"""No layout round trips around the attention kernels of a cached graph.

HF T5's decoder step: self-attention reads the packed projection (its K went through
``permute(0, 2, 3, 1)`` + ``transpose(-1, -2)``, two Transposes composing to (0, 2, 1, 3)),
cross-attention reads the cached cross K/V graph inputs as they are (4-D), and no Transpose
or Reshape stands between a projection and a kernel; parity and greedy tokens against eager
PyTorch hold."""

import numpy as np
import onnx
import pytest

import tfgraph
from tests.passes.cache.test_slice_machinery import save_hf_t5
from tfgraph.runtime import CachedDecoder, Session
from tfgraph.runtime.generate import left_pad
from tfgraph.sources import load_source
from tfgraph.verify.generation_parity import compare_greedy


# slow: 3 min on HF T5 (every step graph checked); the zoo t5-tiny keeps the layouts in
# the default tier
@pytest.mark.slow
def test_hf_t5_step_has_no_transposes_and_reads_cross_kv_as_is(tmp_path):
    source = save_hf_t5(tmp_path / "hf", vocab=200, d_model=64, d_kv=16)
    result = tfgraph.export(source, tmp_path / "a", kv_cache=True)
    parity = result.report["parity"]
    assert parity["prefill"]["passed"] and parity["decode"]["passed"]
    assert parity["decode"]["max_abs_err"] < 1e-4

    step = onnx.load(tmp_path / "a" / "model.onnx")
    inputs = {i.name for i in step.graph.input}
    producers = {o: n.op_type for n in step.graph.node for o in n.output}
    kernels = [n for n in step.graph.node if n.domain == "com.microsoft"]
    # left: the bias table's permute and the tied LM head's weight (ORT folds that one)
    transposed = [producers.get(n.input[0]) for n in step.graph.node if n.op_type == "Transpose"]
    assert "MatMul" not in transposed and "Reshape" not in transposed, transposed
    fed = {producers.get(i) for n in kernels for i in n.input[:3] if i}
    assert not fed & {"Transpose", "Reshape"}, fed
    mha = [n for n in step.graph.node if n.op_type == "MultiHeadAttention"]
    assert len(mha) == 2
    assert all(n.input[1] in inputs and n.input[2] in inputs for n in mha)
    gqa = [n for n in step.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(list(n.input[1:3]) == ["", ""] for n in gqa)

    decoder = CachedDecoder(Session(tmp_path / "a"))
    prompts = [[5, 9, 14, 3, 8, 2], [11, 4, 6]]
    ids, mask = left_pad([p + [1] for p in prompts], 0)
    comparison = compare_greedy(
        load_source(source, attn_implementation="eager"), decoder, [[0], [0]], 10,
        extra={"input_ids": ids, "attention_mask": mask}, pad=0,
    )  # fmt: skip
    assert all(row["passed"] for row in comparison.steps), comparison.steps
    assert comparison.tokens == comparison.want_tokens
    assert np.asarray(comparison.tokens).shape == (2, 10)
