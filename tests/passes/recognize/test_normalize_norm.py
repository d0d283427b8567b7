"""RMSNorm written with an L2 norm (``F.normalize``, ``x.norm``, a sum of squares) as third-party
libraries write it: fused into one RMSNorm per norm, parity with eager, and every norm-like
subgraph counted as a candidate, with a reason when it is not fused (issue 47)."""

import math

import numpy as np
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from ort_run import run_onnx
from torch import nn

from tfgraph import from_module
from tfgraph.exporters.compile import check_model, count_fusions, run_pipeline
from tfgraph.exporters.targets import get_target
from tfgraph.passes.lower.lower_norms import LowerNormsPass
from tfgraph.passes.pipeline.fusions import op_histogram
from tfgraph.passes.recognize.fuse_norms import FuseNormsPass
from tfgraph.passes.recognize.normalize_rules import LpNormalizationRule
from tfgraph.sources.trace import trace

C, HEADS, EPS = 32, 4, 1e-6


class _Norm(nn.Module):
    """A per-feature γ (not all ones, so a lost γ shows) and the √d scale."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(1 + 0.1 * torch.randn(C))
        self.scale = C**0.5


class ScaledNormalize(_Norm):  # lucidrains-style RMSNorm
    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.g


class NormalizeGamma(_Norm):  # no √d: the scale lives in γ
    def forward(self, x):
        return F.normalize(x, dim=-1) * self.g


class ClampedNorm(_Norm):
    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True).clamp(min=EPS) * self.scale * self.g


class RsqrtScalar(_Norm):  # a learned scalar besides γ
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.s * self.g


class SumSqrt(_Norm):  # ε under the root: ε/d as RMSNorm's ε, exactly
    def forward(self, x):
        return x / (x.pow(2).sum(-1, keepdim=True) + EPS).sqrt() * self.scale * self.g


class Block(nn.Module):
    """Pre-norm: ``x + attn(norm1(x))``, ``x + mlp(norm2(x))``, causal SDPA."""

    def __init__(self, norm1: type, norm2: type) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm1(), norm2()
        self.qkv, self.out = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.mlp = nn.Sequential(nn.Linear(C, 2 * C), nn.SiLU(), nn.Linear(2 * C, C))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, C // HEADS).unbind(2)
        q, k, v = (a.transpose(1, 2) for a in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, C))
        return x + self.mlp(self.norm2(x))


class Tiny(nn.Module):
    """Two pre-norm blocks and a final norm: five norms, ``norms`` in that order (the first
    and third read the block's input, the others a residual sum: a skip norm on ORT)."""

    def __init__(self, norms: list[type]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(*norms[:2]), Block(*norms[2:4])])
        self.norm = norms[4]()

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


NORMS = [ScaledNormalize, NormalizeGamma, ClampedNorm, RsqrtScalar, SumSqrt]
NORM_MODULES = ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "norm"]
X = np.random.default_rng(0).standard_normal((3, 7, C)).astype(np.float32)


def _export(module: nn.Module) -> tuple[dict, ir.Model]:
    """The norm report of the traced graph, and the graph through the default pipeline."""
    model = trace(from_module(module, (torch.randn(2, 5, C),)))
    before = count_fusions(model, "none", target="ort")["norm"]
    run_pipeline(model, "default", target="ort")
    check_model(model, "fused")
    return before, model


def _check_fused(module: nn.Module, before: dict, model: ir.Model) -> dict:
    """Five candidates before, five fused after, no decomposed norm left, parity with eager;
    the report after."""
    assert (before["fused"], before["total"]) == (0, 5)  # counted before any fusion
    report = count_fusions(model, target="ort")["norm"]
    assert (report["fused"], report["total"], report["missed"]) == (5, 5, [])
    hist = op_histogram(model)
    assert sum(n for op, n in hist.items() if "SimplifiedLayerNormalization" in op) == 5, hist
    assert not {"ReduceL2", "ReduceSum", "Sqrt", "Max", "Clip"} & set(hist), hist
    with torch.no_grad():
        want = module(torch.from_numpy(X)).numpy()
    got = run_onnx(model, X, optimize=False)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    return report


@pytest.fixture(scope="module")
def mixed():
    """One transformer with each form in one of its five norms."""
    module = Tiny(NORMS).eval()
    return module, *_export(module)


def test_each_form_fuses_with_parity(mixed):
    report = _check_fused(*mixed)
    assert sorted(f["module"] for f in report["fused_layers"]) == sorted(NORM_MODULES)


# slow: five traces of the transformer (~3 s each); the mixed model above has every form once
@pytest.mark.slow
@pytest.mark.parametrize("norm", NORMS, ids=lambda n: n.__name__)
def test_every_norm_of_one_form_fuses_with_parity(norm):
    module = Tiny([norm] * 5).eval()
    _check_fused(module, *_export(module))


class Normalize(nn.Module):
    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return F.normalize(x, dim=self.dim) * C**0.5


def _fused(module, example):
    """The module traced, its norms fused and lowered for ONNX Runtime; its output on ``X``
    before the fusion; the canonical ops the fusion made."""
    model = trace(from_module(module, example))
    run_pipeline(model, "cleanup")
    want = run_onnx(model, X, optimize=False)[0]
    FuseNormsPass()(model)
    canonical = [n.op_type for n in model.graph if n.domain == "tfgraph"]
    LowerNormsPass(get_target("ort"))(model)
    return model, want, canonical


def test_near_zero_rows_follow_the_epsilon_bound():
    """``max(‖x‖, ε)`` became ``√(‖x‖² + ε²)``: a zero row stays 0 (not NaN), a row at 10⁴·ε
    is within ½(ε/‖x‖)² = 5e-9 (fp32 rounding), a row at ε differs by at most a factor √2."""
    model, _, canonical = _fused(Normalize(), (torch.randn(2, 5, C),))
    assert canonical == ["RMSNorm"]
    x = np.ones((1, 3, C), np.float32)
    x[0, 0] = 0
    x[0, 1] *= 1e4 * 1e-12 / math.sqrt(C)  # ‖x‖ = 10⁴·ε
    x[0, 2] *= 1e-12 / math.sqrt(C)  # ‖x‖ = ε
    got = run_onnx(model, x, optimize=False)[0]
    want = F.normalize(torch.from_numpy(x), dim=-1).numpy() * C**0.5
    assert np.all(got[0, 0] == 0)
    np.testing.assert_allclose(got[0, 1], want[0, 1], rtol=1e-6)
    ratio = got[0, 2] / want[0, 2]
    np.testing.assert_allclose(ratio, 1 / math.sqrt(2), rtol=1e-3)


def test_normalize_over_another_axis_is_a_candidate_with_a_reason():
    model, want, canonical = _fused(Normalize(dim=1), (torch.randn(2, 5, C),))
    assert canonical == []
    norm = count_fusions(model, target="ort")["norm"]
    assert (norm["fused"], norm["total"]) == (0, 1)
    assert "normalizes over axes [1], not the last axis alone" in norm["missed"][0]["reason"]
    np.testing.assert_allclose(run_onnx(model, X, optimize=False)[0], want)


class Lp(nn.Module):
    def forward(self, x):
        return x * 2.0


def test_lp_normalization_is_counted_with_its_reason():
    """ONNX's own ``LpNormalization`` (torch never emits it): a norm, left as is, counted."""
    model = trace(from_module(Lp(), (torch.randn(2, 5, C),)))
    node = next(n for n in model.graph if n.op_type == "Mul")
    lp = ir.node("LpNormalization", [node.inputs[0]], {"axis": -1, "p": 2})
    model.graph.insert_before(node, lp)
    node.replace_input_with(0, lp.outputs[0])
    FuseNormsPass()(model)
    norm = count_fusions(model, target="ort")["norm"]
    assert (norm["fused"], norm["total"]) == (0, 1)
    assert norm["missed"][0]["reason"] == LpNormalizationRule.REASON
