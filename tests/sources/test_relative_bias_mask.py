"""A relative position bias passed as SDPA's ``attn_mask`` (issue 47, section 2): the model
below is written as third-party libraries write T5-style attention (bucketed relative
positions → ``nn.Embedding`` → ``[1, H, L, L]``, maybe expanded to the batch, as
``F.scaled_dot_product_attention(q, k, v, attn_mask=bias)``; the output reshaped with
``out.transpose(1, 2).view(B, L, H * D)``). It runs under ``torch.no_grad()`` and failed to
trace ("Cannot view a tensor with shape [s72, s70, 4, 32] … as (s72, s70, 128)"): torch.export
traced with autograd on, where PyTorch's CPU attention takes another back-end with another
output layout (:mod:`tfgraph.sources.inference_trace`). Traced under ``no_grad``, it exports
with its batch and sequence dynamic."""

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tfgraph
from tfgraph.errors import TfgraphError
from tfgraph.sources import from_module
from tfgraph.sources.causal_mask import CausalMaskFolded, folded
from tfgraph.sources.inference_trace import for_inference
from tfgraph.sources.trace import trace

VOCAB, DIM, HEADS, BUCKETS = 64, 32, 4, 16
VIEW_FAILS = "Cannot view a tensor with shape|view size is not compatible"


def relative_buckets(relative: torch.Tensor, *, bidirectional: bool) -> torch.Tensor:
    """T5's bucketing: exact buckets for small distances, logarithmic ones beyond (up to 64)."""
    buckets, out = BUCKETS, 0
    if bidirectional:
        buckets //= 2
        out = (relative > 0).long() * buckets
        distance = relative.abs()
    else:
        distance = -torch.min(relative, torch.zeros_like(relative))
    exact = buckets // 2
    large = (
        exact
        + (torch.log(distance.float() / exact) / math.log(64 / exact) * (buckets - exact)).long()
    )
    large = torch.min(large, torch.full_like(large, buckets - 1))
    return out + torch.where(distance < exact, distance, large)


class RelativeBiasAttention(nn.Module):
    """Self-attention whose relative position bias is SDPA's ``attn_mask``. ``batch_bias``:
    the bias expanded to ``[B, H, L, L]``; ``causal``: unidirectional buckets and
    ``is_causal=True``; ``view``: ``.view`` of the output (else ``.reshape``)."""

    def __init__(self, *, batch_bias=False, causal=False, view=True, contiguous=False) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.bias = nn.Embedding(BUCKETS, HEADS)
        self.batch_bias, self.causal = batch_bias, causal
        self.view, self.contiguous = view, contiguous

    def position_bias(self, length: int, device) -> torch.Tensor:
        context = torch.arange(length, device=device)[:, None]
        memory = torch.arange(length, device=device)[None, :]
        buckets = relative_buckets(memory - context, bidirectional=not self.causal)
        return self.bias(buckets).permute(2, 0, 1).unsqueeze(0)  # (1, H, L, L)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, n, _ = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        bias = self.position_bias(n, h.device)
        if self.batch_bias:
            bias = bias.expand(b, -1, -1, -1)  # (B, H, L, L)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=self.causal)
        out = out.transpose(1, 2)  # (B, L, H, D)
        if self.contiguous:
            out = out.contiguous()
        out = out.view(b, n, DIM) if self.view else out.reshape(b, n, DIM)
        return self.out(out)


class RelativeBiasLM(nn.Module):
    """Embedding → one attention per variant given → head."""

    def __init__(self, *variants: dict) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(RelativeBiasAttention(**v) for v in variants or ({},))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def _exported(model: nn.Module, dims: dict):
    ids = torch.randint(0, VOCAB, (2, 9))
    return torch.export.export(model, (ids,), dynamic_shapes=(dims,), strict=False)


def test_the_view_fails_with_autograd_on_whatever_the_batch():
    """The cause: with autograd on, SDPA's output has the math back-end's layout, in eager
    PyTorch as in torch.export, where a fixed batch fails the same way."""
    torch.manual_seed(0)
    model = RelativeBiasLM().eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        model(ids)  # eager inference runs
    with pytest.raises(RuntimeError, match=VIEW_FAILS):
        model(ids)  # eager with autograd on does not
    with pytest.raises(Exception, match=VIEW_FAILS):
        _exported(model, {})  # nor does a trace with every dim fixed


# the layouts that failed (a bias broadcast or expanded to the batch, causal or not, with
# ``.view``) and the two that always traced (``.reshape``; ``.contiguous().view``)
_VARIANTS = [
    *({"batch_bias": b, "causal": c} for b, c in itertools.product((False, True), repeat=2)),
    {"batch_bias": True, "view": False},
    {"causal": True, "contiguous": True},
]


def test_every_variant_traces_for_inference_with_a_dynamic_batch():
    """Each variant (one layer each, one trace), traced under :func:`for_inference`: the graph
    computes the eager model at two batch sizes."""
    dynamic = {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}
    torch.manual_seed(0)
    model = RelativeBiasLM(*_VARIANTS).eval()
    with for_inference():
        traced = _exported(model, dynamic).module()
    assert torch.is_grad_enabled()  # restored after the block
    for batch, length in ((1, 7), (3, 12)):
        ids = torch.randint(0, VOCAB, (batch, length))
        with torch.no_grad():
            torch.testing.assert_close(traced(ids), model(ids))


@pytest.mark.parametrize("boolean", [False, True])
def test_a_causal_flag_beside_a_mask_is_folded_as_the_flash_kernel_applies_it(boolean):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, HEADS, 5, 8).unbind(0)
    mask = torch.rand(1, HEADS, 5, 5) > 0.3 if boolean else torch.randn(1, HEADS, 5, 5)
    if boolean:
        mask[..., 0] = True  # every query sees a key
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
        with CausalMaskFolded() as mode:
            got = F.scaled_dot_product_attention(q, k, v, mask, 0.0, True)  # by position
            again = torch.nn.functional.scaled_dot_product_attention(
                query=q, key=k, value=v, attn_mask=mask, is_causal=True
            )
    assert mode.count == 2
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(again, want)
    above = ~torch.ones(5, 5, dtype=torch.bool).tril()  # the keys after each query
    hidden = folded(mask, q, k)[..., above]
    assert (~hidden).all() if boolean else torch.isneginf(hidden).all()


def test_the_trace_runs_for_inference(monkeypatch):
    """tfgraph's trace calls torch.onnx.export under :func:`for_inference` (checked without
    exporting: the exporter is replaced by a probe of the grad mode and the torch function
    mode)."""
    seen = {}

    def probe(*args, **kwargs):
        seen["grad"] = torch.is_grad_enabled()
        seen["folding"] = isinstance(torch.overrides._get_current_function_mode(), CausalMaskFolded)
        raise RuntimeError("probe")

    monkeypatch.setattr(torch.onnx, "export", probe)
    source = from_module(RelativeBiasLM(), torch.randint(0, VOCAB, (2, 9)))
    with pytest.raises(TfgraphError, match="probe"):
        trace(source)
    assert seen == {"grad": False, "folding": True}
    assert torch.is_grad_enabled()
    hugging_face = dataclasses.replace(source, info={"model_type": "t5"})
    with for_inference(hugging_face):  # traced as before (the module docstring says why)
        assert torch.is_grad_enabled()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One export of a model with the two failing layouts: a broadcast bias, and a causal one
    (``is_causal=True`` beside the mask) expanded to the batch, both with ``.view``."""
    torch.manual_seed(0)
    model = RelativeBiasLM({}, {"batch_bias": True, "causal": True})
    source = from_module(model, torch.randint(0, VOCAB, (2, 9)))
    return tfgraph.export(source, tmp_path_factory.mktemp("relbias") / "art")


@pytest.mark.slow  # a full export with ONNX Runtime parity: ~25 s on a loaded 2-core machine
def test_relative_bias_model_exports_with_a_dynamic_batch(exported):
    parity = exported.report["parity"]
    assert parity["passed"], parity["outputs"]
    assert len({batch for batch, _ in parity["shapes"]}) >= 2, parity  # two batch sizes
    (ids,) = exported.manifest["inputs"]
    assert ids["shape"] == ["batch", "sequence"]
    assert "static_axes" not in exported.manifest  # no fixed batch
    attention = exported.report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == 2, attention
