"""Tracing removes ``x + 0``, ``x · 1`` … only when the constant is exactly the identity.

onnxscript's own no-op rules are tolerant (``abs_tol`` 1e-8, ``rel_tol`` 1e-5); the fuzzer found
the seed's ``σ + 1e-12`` removed by them. These tests pin the exact replacements and the bug.
"""

import numpy as np
import onnx_ir as ir
import pytest
import torch
from ort_run import run_onnx
from torch import nn

from tfgraph import from_module
from tfgraph.exporters.compile import count_fusions, run_pipeline
from tfgraph.models.norms import SeedLayerNorm
from tfgraph.passes.recognize.fuse_norms import FuseNormsPass
from tfgraph.passes.recognize.norm_rules import SeedLayerNormRule
from tfgraph.sources.trace import trace


class Op(nn.Module):
    def __init__(self, kind: str, constant: float) -> None:
        super().__init__()
        self.kind, self.constant = kind, constant

    def forward(self, x):
        c = self.constant
        return {"add": x + c, "radd": c + x, "sub": x - c, "mul": x * c, "div": x / c}[self.kind]


def _ops(module) -> list[str]:
    model = trace(from_module(module, (torch.randn(2, 3, 4),)))
    return [n.op_type for n in model.graph]


@pytest.mark.parametrize(
    ("kind", "identity", "near"),
    [
        ("add", 0.0, 1e-12),
        ("radd", 0.0, -1e-9),
        ("sub", 0.0, 1e-12),
        ("mul", 1.0, 1.000001),
        ("div", 1.0, 1 - 1e-6),
    ],
)
def test_only_exact_identities_are_removed(kind, identity, near):
    op_type = {"add": "Add", "radd": "Add", "sub": "Sub", "mul": "Mul", "div": "Div"}[kind]
    assert op_type not in _ops(Op(kind, identity))
    assert op_type in _ops(Op(kind, near))  # onnxscript's tolerant rule would drop it


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    return run_onnx(model, x)[0]


def test_seed_norm_with_tiny_eps_keeps_eps_constant_row_stays_finite():
    """``(x − μ)/(σ + 1e-12)`` of a constant row is 0 in eager; without ε it is 0/0 = NaN."""
    norm = SeedLayerNorm(8, eps=1e-12).eval()
    x = torch.randn(1, 3, 8)
    x[0, 1] = 2.5  # a constant row: σ = 0
    model = trace(from_module(norm, (x,)))
    got = _run(model, x.numpy())
    want = norm(x).detach().numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_seed_norm_with_tiny_eps_is_reported_excluded():
    model = trace(from_module(SeedLayerNorm(8, eps=1e-12), (torch.randn(2, 5, 8),)))
    run_pipeline(model, "cleanup")
    FuseNormsPass()(model)
    norm = count_fusions(model)["norm"]
    assert (norm["fused"], norm["total"]) == (0, 0)
    assert [m["reason"] for m in norm["missed"]] == [SeedLayerNormRule.REASON]
    assert norm["missed"][0]["excluded"] is True


class Baddbmm(nn.Module):
    """GPT-NeoX-Japanese's scores: ``baddbmm`` from a zeros tensor of the product's shape."""

    def forward(self, x):
        zeros = torch.zeros(x.shape[0], x.shape[1], x.shape[1], dtype=x.dtype)
        return torch.baddbmm(zeros, x, x.transpose(1, 2), beta=1.0, alpha=0.5)


def test_adding_expanded_zeros_of_the_same_shape_is_removed():
    model = trace(from_module(Baddbmm(), (torch.randn(2, 3, 4),)))
    assert "Add" not in [n.op_type for n in model.graph]
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    want = Baddbmm()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(_run(model, x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("shape", "value"),
    [("[3, 2, 3]", "0.0"), ("[2, 3]", "1.0")],
    ids=["broadcasts-x-larger", "not-zero"],
)
def test_expanded_zeros_that_change_the_result_stay(shape, value):
    """Rejections: zeros that broadcast x to a larger shape; an expanded constant that is
    not 0."""
    from onnxscript.rewriter import RewriteRuleSet

    from tfgraph.passes.recognize.exact_no_op import EXACT_NO_OP_RULES

    model = ir.from_onnx_text(f"""
    <ir_version: 10, opset_import: ["" : 20]>
    g (float[2, 3] x) => (float[{shape[1:-1]}] y) {{
        c = Constant <value = float {{{value}}}> ()
        s = Constant <value = int64[{len(shape.split(","))}] {{{shape[1:-1]}}}> ()
        z = Expand (c, s)
        y = Add (x, z)
    }}
    """)
    ir.passes.common.ShapeInferencePass()(model)
    assert RewriteRuleSet(EXACT_NO_OP_RULES).apply_to_model(model) == 0
    assert "Add" in [n.op_type for n in model.graph]
