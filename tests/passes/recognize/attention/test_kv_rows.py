"""Rows whose KV cache or token check failed for a reason in the classifier or the harness.

1. GIT: the mask reads ``attention_mask`` both as data (padding) and through ``Shape`` (its
   size), and the shape of an activation computed by a fused op (``zeros_like(embeddings)``):
   the bias is evaluable with a stand-in for that activation only.
2. VibeVoice: an export without an ``attention_mask`` input generates each prompt alone.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tfgraph.passes.recognize.attention.classify_bias import Subgraphs, _cone, evaluate_biases
from tfgraph.tools import coverage_generation

MASK_FROM_INPUT_AND_ACTIVATION_SHAPE = """
<ir_version: 10, opset_import: ["" : 20, "custom" : 1]>
g (float[batch,sequence] attention_mask, float[batch,sequence,4] x)
  => (float[batch,sequence] bias) <float[batch,sequence,4] h> {
  h = custom.Fused(x)
  hs = Shape(h)
  starts = Constant<value = int64[1] {0}>()
  ends = Constant<value = int64[1] {2}>()
  bs = Slice(hs, starts, ends)
  zeros = ConstantOfShape<value = float[1] {0}>(bs)
  ms = Shape(attention_mask)
  mask = Expand(attention_mask, ms)
  bias = Add(mask, zeros)
}
"""


def _bias_model():
    model = ir.from_onnx_text(MASK_FROM_INPUT_AND_ACTIVATION_SHAPE)
    return model, model.graph.outputs[0]


def test_input_read_as_data_and_shape_needs_no_stand_in():
    model, bias = _bias_model()
    assert _cone(bias, cut_shapes=False) is None  # through the fused op
    stand_ins = _cone(bias, cut_shapes=True)
    assert [v.name for v in stand_ins] == ["h"]  # attention_mask is walked as data


def test_mask_beside_activation_shape_is_evaluated():
    model, bias = _bias_model()
    (value,) = evaluate_biases(model, [bias], 7, False, token=1, subgraphs=Subgraphs(model))
    assert value is not None and value.shape[0] == 2  # batch 2, the probe's sequence length
    np.testing.assert_array_equal(value, np.ones_like(value))


class _NoMaskDecoder:
    mask_input = None


def test_prompts_go_alone_without_a_mask_input(monkeypatch):
    calls = []

    def fake_generate(decoder, prompts, config):
        calls.append([len(p) for p in prompts])

        class Out:
            tokens = [[len(p)] for p in prompts]

        return Out

    monkeypatch.setattr("tfgraph.runtime.generate", fake_generate)
    got = coverage_generation._generate_rows(_NoMaskDecoder(), [[1, 2], [3, 4, 5]], None)
    assert calls == [[2], [3]] and got == [[2], [3]]
    calls.clear()
    decoder = _NoMaskDecoder()
    decoder.mask_input = "attention_mask"
    assert coverage_generation._generate_rows(decoder, [[1, 2], [3, 4, 5]], None) == [[2], [3]]
    assert calls == [[2, 3]]  # one left-padded batch


def test_difference_is_said_without_index_error():
    diff = coverage_generation._difference
    assert diff([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == "first different token at step 1"
    assert diff([[1, 2]], [[1, 2], [3]]) == "1 rows generated, 2 in the reference"
    assert diff([[1, 2, 3]], [[1, 2]]) == (
        "the first 2 tokens agree; row lengths [3] vs [2] (reference)"
    )
