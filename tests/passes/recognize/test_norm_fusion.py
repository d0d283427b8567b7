"""Norm folding rules on tiny graphs: counts, op histograms, numbers, and every rejection."""

from collections.abc import Callable

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
from tfgraph.passes.recognize.norm_rules import SeedLayerNormRule
from tfgraph.sources.trace import trace

C = 16
EPS = 1e-5


class Norm(nn.Module):
    """A module computing ``fn(x, weight, bias)``: one norm form per test case."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(C, generator=g))
        self.bias = nn.Parameter(0.1 * torch.randn(C, generator=g))
        self.fn = fn

    def forward(self, x):
        return self.fn(x, self.weight, self.bias)


def ln_div(x, w, b):
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + EPS) * w + b


def ln_rsqrt(x, w, b):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) * (x - mu)).mean(-1, keepdim=True)
    return b + w * ((x - mu) * torch.rsqrt(var + EPS))


def ln_moments(x, w, b):  # variance as E[x²] − E[x]²
    mu = x.mean(-1, keepdim=True)
    var = (x * x).mean(-1, keepdim=True) - mu * mu
    return (x - mu) / torch.sqrt(var + EPS) * w + b


def ln_plain(x, w, b):  # no γ, no β
    mu = x.mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt((x - mu).pow(2).mean(-1, keepdim=True) + EPS)


def ln_torch(x, w, b):
    return F.layer_norm(x, (C,), w, b, EPS)


def rms_upcast(x, w, b):  # Llama/T5: fp32 upcast, x * rsqrt(mean(x²) + ε), γ first
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def rms_div(x, w, b):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * w


def rms_plain(x, w, b):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def rms_torch(x, w, b):
    return F.rms_norm(x, (C,), w, EPS)


# form → (canonical op, inputs of the canonical op after folding)
FORMS = {
    ln_div: ("LayerNorm", 3),
    ln_rsqrt: ("LayerNorm", 3),
    ln_moments: ("LayerNorm", 3),
    ln_plain: ("LayerNorm", 1),
    ln_torch: ("LayerNorm", 3),
    rms_upcast: ("RMSNorm", 2),
    rms_div: ("RMSNorm", 2),
    rms_plain: ("RMSNorm", 1),
    rms_torch: ("RMSNorm", 2),
}


def _traced(fn, opset=20, example=None):
    example = example if example is not None else (torch.randn(2, 5, C),)
    return trace(from_module(Norm(fn), example), opset=opset)


def _run(model: ir.Model, x: np.ndarray) -> list[np.ndarray]:
    return run_onnx(model, x, optimize=False)


def _copy(model):
    return ir.from_proto(ir.to_proto(model))


X = np.random.default_rng(0).standard_normal((3, 7, C)).astype(np.float32) * 3 + 1


@pytest.mark.parametrize("fn", list(FORMS), ids=lambda f: f.__name__)
def test_form_folds_and_lowers_exactly(fn):
    op_type, n_inputs = FORMS[fn]
    for opset, targets in ((20, ("ort",)), (23, ("onnx", "tensorrt"))):
        traced = _traced(fn, opset)
        run_pipeline(traced, "cleanup")
        want = _run(traced, X)[0]
        model = _copy(traced)
        assert FuseNormsPass()(model).modified
        canonical = [n for n in model.graph if n.domain == "tfgraph"]
        assert [(n.op_type, len(n.inputs)) for n in canonical] == [(op_type, n_inputs)]
        assert not FuseNormsPass()(model).modified  # a second run finds nothing
        hist = op_histogram(model)
        assert not {"ReduceMean", "Sqrt", "Reciprocal", "Pow"} & set(hist), hist
        assert count_fusions(model)["norm"] == {
            **count_fusions(model)["norm"],
            "fused": 1,
            "total": 1,
            "missed": [],
        }
        for target in targets:
            lowered = _copy(model)
            assert LowerNormsPass(get_target(target))(lowered).modified
            check_model(lowered, f"lowering for {target}")
            assert not any(n.domain == "tfgraph" for n in lowered.graph)
            got = _run(lowered, X)[0]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6, err_msg=target)


EXPECTED_OPS = {
    ("LayerNorm", "ort"): "LayerNormalization",
    ("LayerNorm", "onnx"): "LayerNormalization",
    ("LayerNorm", "tensorrt"): "LayerNormalization",
    ("RMSNorm", "ort"): "SimplifiedLayerNormalization",
    ("RMSNorm", "onnx"): "RMSNormalization",
    ("RMSNorm", "tensorrt"): "RMSNormalization",
}


def test_ort_keeps_layernorm_residual_apart():
    """On the CPU the LayerNorm skip kernel measured slower: the residual Add stays."""
    example = (torch.randn(2, 5, C), torch.randn(2, 5, C))
    model = trace(from_module(Residual(ln_rsqrt), example))
    run_pipeline(model, "cleanup")
    FuseNormsPass()(model)
    LowerNormsPass(get_target("ort"))(model)
    hist = op_histogram(model)
    assert not any("Skip" in op for op in hist), hist
    assert hist["LayerNormalization"] == 1


@pytest.mark.parametrize(("kind", "target"), list(EXPECTED_OPS))
def test_lowering_targets(kind, target):
    fn = ln_div if kind == "LayerNorm" else rms_div
    model = _traced(fn, 20 if target == "ort" else 23)
    run_pipeline(model, "default", target=target)
    norms = {op for op in op_histogram(model) if "Norm" in op}
    assert norms == {EXPECTED_OPS[kind, target]}


class Residual(nn.Module):
    """Pre-LN residual: ``s = a + b``; ``y = s + W·norm(s)``: the sum is used twice."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.norm = Norm(fn)
        self.proj = nn.Linear(C, C)

    def forward(self, a, b):
        s = a + b
        return s + self.proj(self.norm(s))


@pytest.mark.parametrize(
    ("fn", "op", "target"),
    [
        (ln_rsqrt, "SkipLayerNormalization", "ort-cuda"),
        (rms_upcast, "SkipSimplifiedLayerNormalization", "ort-cuda"),
        (rms_upcast, "SkipSimplifiedLayerNormalization", "ort"),  # RMS only on the CPU
    ],
)
def test_residual_add_folds_into_skip_norm(fn, op, target):
    example = (torch.randn(2, 5, C), torch.randn(2, 5, C))
    model = trace(from_module(Residual(fn), example))
    run_pipeline(model, "cleanup")
    feeds = {"a": X, "b": X[::-1].copy()}
    want = run_onnx(model, feeds, optimize=False)
    run_pipeline(model, "cleanup")
    FuseNormsPass()(model)
    LowerNormsPass(get_target(target))(model)
    check_model(model, "skip lowering")
    hist = op_histogram(model)
    assert hist[f"com.microsoft::{op}"] == 1
    assert "Add" in hist and hist["Add"] <= 2  # the residual sum now comes from the skip norm
    skip = next(n for n in model.graph if n.op_type == op)
    assert skip.outputs[3].uses()  # the sum feeds the second residual
    got = run_onnx(model, feeds, optimize=False)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=2e-6)


def rms_no_weight(x, w, b):
    """nanochat's norm: no weight at all."""
    return F.rms_norm(x, (x.size(-1),), eps=EPS)


def test_weightless_norm_after_a_residual_folds_without_a_cycle():
    """Its ones are a constant of the static width: read off ``Shape(sum)`` they made the skip
    kernel's sum feed its own scale (a cycle; nanochat's export failed in the final sort)."""
    example = (torch.randn(2, 5, C), torch.randn(2, 5, C))
    model = trace(from_module(Residual(rms_no_weight), example))
    run_pipeline(model, "cleanup")
    feeds = {"a": X, "b": X[::-1].copy()}
    want = run_onnx(model, feeds, optimize=False)
    FuseNormsPass()(model)
    LowerNormsPass(get_target("ort"))(model)
    model.graph.sort()  # raised "Graph contains a cycle"
    check_model(model, "skip lowering")
    assert op_histogram(model)["com.microsoft::SkipSimplifiedLayerNormalization"] == 1
    got = run_onnx(model, feeds, optimize=False)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=2e-6)


def test_tensorrt_before_10_15_keeps_rmsnorm_decomposed():
    model = _traced(rms_div, 23)
    run_pipeline(model, "cleanup")
    want = _run(model, X)[0]
    FuseNormsPass()(model)
    LowerNormsPass(get_target("tensorrt@10.14"))(model)
    norm = count_fusions(model)["norm"]
    assert (norm["fused"], norm["total"]) == (0, 1)
    assert "TensorRT 10.14 does not parse RMSNormalization" in norm["missed"][0]["reason"]
    np.testing.assert_allclose(_run(model, X)[0], want, rtol=1e-5, atol=2e-6)


# --- rejections: each reason, on the smallest graph that shows it --------------------------


def _fold_and_report(module, example) -> dict:
    model = trace(from_module(module, example))
    run_pipeline(model, "cleanup")
    result = FuseNormsPass()(model)
    assert not result.modified
    assert not any(n.domain == "tfgraph" for n in model.graph)
    return count_fusions(model)["norm"]


class EpsInput(nn.Module):
    def forward(self, x, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class WrongAxis(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + EPS)


class ReusedVariance(nn.Module):
    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + EPS) + var  # the variance is used outside the norm


def seed_norm(x, w, b):
    mu = x.mean(-1, keepdim=True)
    sigma = (x - mu).pow(2).mean(-1, keepdim=True).sqrt()
    return w * (x - mu) / (sigma + EPS) + b


@pytest.mark.parametrize(
    ("module", "example", "reason"),
    [
        (
            EpsInput(),
            (torch.randn(2, 5, C), torch.full((2, 5, 1), EPS)),
            "epsilon is not a constant",
        ),
        (WrongAxis(), (torch.randn(2, 5, C),), "not the last axis alone"),
        (ReusedVariance(), (torch.randn(2, 5, C),), "other uses"),
    ],
    ids=["non-constant-eps", "wrong-axis", "reused-intermediate"],
)
def test_rejection_reasons(module, example, reason):
    norm = _fold_and_report(module, example)
    assert norm["fused"] == 0 and norm["total"] == 1
    assert reason in norm["missed"][0]["reason"]


def test_seed_sigma_plus_eps_is_excluded_with_reason():
    norm = _fold_and_report(Norm(seed_norm), (torch.randn(2, 5, C),))
    assert (norm["fused"], norm["total"]) == (0, 0)
    assert norm["missed"] == [{"module": "", "reason": SeedLayerNormRule.REASON, "excluded": True}]
