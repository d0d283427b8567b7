"""The older BART-family attention layout (``attention_rules.BmmAttentionRule``):
``bmm`` over (batch·heads, ·, ·) with the scores viewed 4-D only to add the mask (TrOCR,
XGLM with its ``Max(·, lowest)`` clamp and a round trip of the probabilities, MVP's cross
attention without a mask). Each Hugging Face model, built tiny from its config, is complete in
the coverage sense: every attention fused, parity, a KV cache, and greedy tokens equal to
``generate``."""

import onnx_ir as ir
import pytest

from tfgraph.passes.recognize.attention.rules import BmmAttentionRule
from tfgraph.passes.rewrite_utils import diagnose
from tfgraph.tools import coverage

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("model_type", "kind", "cls"),
    [
        ("xglm", "causal-lm", "XGLMForCausalLM"),
        # slow: bmm-layout HF architectures as coverage rows; xglm stays
        pytest.param("mvp", "seq2seq-lm", "MvpForConditionalGeneration", marks=pytest.mark.slow),
    ],
)
def test_bmm_layout_models_are_complete(model_type, kind, cls, tmp_path):
    row = coverage.measure(model_type, kind, cls, tmp_path)
    assert row["status"] == "exported", row
    fused, total = row["attention"]
    assert fused == total > 0, row.get("attention_missed")
    assert row["parity"] and row["kv_cache"] and row["kv_parity"], row
    assert row["tokens_equal"] and row["tokens_reference"] == "Hugging Face generate", row


def test_a_clamp_above_the_lowest_value_is_not_dropped():
    """Rejection: ``Max(scores + mask, -10000)`` changes every score below −10000; only a
    clamp at the dtype's lowest value is a no-op on the masks it guards."""
    text = """
    <ir_version: 10, opset_import: ["" : 20]>
    g (float[6, 5, 4] q3, float[6, 4, 5] kt3, float[6, 5, 4] v3, float[2, 1, 5, 5] mask)
        => (float[2, 3, 5, 4] y) {
        s4 = Constant <value = int64[4] {2, 3, 5, 5}> ()
        s3 = Constant <value = int64[3] {6, 5, 5}> ()
        so = Constant <value = int64[4] {2, 3, 5, 4}> ()
        low = Constant <value = float {CLAMP}> ()
        bmm = MatMul (q3, kt3)
        scores4 = Reshape (bmm, s4)
        masked = Add (scores4, mask)
        clamped = Max (masked, low)
        scores3 = Reshape (clamped, s3)
        probs = Softmax <axis: int = -1> (scores3)
        out3 = MatMul (probs, v3)
        y = Reshape (out3, so)
    }
    """
    rule = BmmAttentionRule.rule(True, True, False)
    for clamp, fused in (("-10000.0", False), ("-3.4028234663852886e+38", True)):
        model = ir.from_onnx_text(text.replace("CLAMP", clamp))
        ir.passes.common.ShapeInferencePass()(model)
        root = next(n for n in model.graph if n.outputs[0].name == "y")
        reason = diagnose(model, [rule], root, depth=0)
        if fused:
            assert rule.apply_to_model(model) == 1
        else:
            assert "clamped at a value other than the lowest" in reason
