"""Hand-written norms fold whatever the order of their products (``passes/norm_products.py``):
``w * x * rsqrt(ms)``, ``rsqrt(ms) * w * x``, ``x * (w * rsqrt(ms))``, ``w * x / sqrt(ms)``, …
for RMSNorm and LayerNorm, with parity against eager."""

from __future__ import annotations

import idiom_models
import onnx_ir as ir
import pytest
from pipeline_check import compile_and_prove

from tfgraph.passes.recognize.norm_products import reorder_norm_products
from tfgraph.sources import from_module
from tfgraph.sources.trace import trace

ORDERS = len(idiom_models.RMS_ORDERS)


# slow: onnx (11 s); every order folds before lowering, and ort stays
@pytest.mark.parametrize("target", ["ort", pytest.param("onnx", marks=pytest.mark.slow)])
def test_every_operand_order_folds(target, tmp_path):
    source = from_module(idiom_models.every_norm_order(), origin="idiom:every_norm_order")
    traced = trace(source, opset=20 if target == "ort" else 23)
    result = compile_and_prove(source, traced, "default", target, tmp_path)
    assert result["parity"]["passed"], result["parity"]["outputs"]
    norm = result["fusions"]["norm"]
    assert (norm["fused"], norm["total"]) == (2 * ORDERS, 2 * ORDERS), norm["missed"]


def _model(expr: str, extra_inputs: str = "") -> ir.Model:
    return ir.from_onnx_text(f"""
    <ir_version: 10, opset_import: ["" : 20]>
    g (float[2, 8] x{extra_inputs}) => (float[2, 8] y) {{
        w = Constant <value = float[8] {{1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0}}> ()
        sq = Mul (x, x)
        axes = Constant <value = int64[1] {{-1}}> ()
        ms = ReduceMean (sq, axes)
        eps = Constant <value = float {{1e-5}}> ()
        v = Add (ms, eps)
        s = Sqrt (v)
        r = Reciprocal (s)
        {expr}
    }}
    """)


def test_reorders_scale_first_product():
    model = _model("t = Mul (w, x)\n        y = Mul (t, r)")
    assert reorder_norm_products(model) == 1
    y = model.graph.outputs[0].producer()
    inner = y.inputs[0].producer()
    assert y.op_type == "Mul" and y.inputs[1].name == "w"
    assert inner.op_type == "Mul" and [i.name for i in inner.inputs] == ["x", "r"]
    assert reorder_norm_products(model) == 0  # canonical now


def test_reorders_scaled_division():
    model = _model("t = Mul (x, w)\n        y = Div (t, s)")
    assert reorder_norm_products(model) == 1
    y = model.graph.outputs[0].producer()
    assert y.op_type == "Mul" and y.inputs[0].producer().op_type == "Div"


@pytest.mark.parametrize(
    ("expr", "extra", "why"),
    [
        (
            "t = Mul (z, x)\n        y = Mul (t, r)",
            ", float[2, 8] z",
            "the scale is not a constant",
        ),
        ("t = Mul (r, x)\n        y = Mul (t, r)", "", "two normalizers"),
        ("t = Mul (w, x)\n        y = Mul (t, s)", "", "no normalizer (Sqrt, not its reciprocal)"),
    ],
)
def test_leaves_other_products_alone(expr, extra, why):
    model = _model(expr, extra)

    def structure():
        return [(n.op_type, [i.name for i in n.inputs]) for n in model.graph]

    before = structure()
    assert reorder_norm_products(model) == 0, why
    assert structure() == before
