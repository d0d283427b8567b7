"""Shifted-window attention (Swin): the scores (B·nW, H, N, N) viewed per image, the shift mask
of each window (nW, N, N) added, viewed back before the softmax, fuse into one
``tfgraph.Attention`` per layer with the mask as a (B·nW, 1, N, N) bias
(:mod:`tfgraph.passes.recognize.attention.windowed_mask`), and keep parity with eager PyTorch;
a view the rule cannot state as a bias is missed with a reason a user can read, never the
matcher's raw text ("OpType mismatch: expected Add, got Reshape.")."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common
import pytest
import torch
from torch import nn

import tfgraph
from tests.passes.recognize.attention.test_attention_rules_more import _attention
from tfgraph.exporters.compile import count_fusions
from tfgraph.passes.canonical import AttentionOp
from tfgraph.passes.pipeline.fusions import op_histogram
from tfgraph.passes.recognize.attention.classify_bias import ClassifyAttentionBiasPass
from tfgraph.passes.recognize.attention.fuse import FuseAttentionPass
from tfgraph.passes.rewrite_utils import readable_reason

DIM, HEADS, WINDOW, SHIFT, GRID = 16, 2, 4, 2, 8  # 8×8 tokens, 4×4 windows: nW = 4, N = 16
N = WINDOW * WINDOW


def _windows(x: torch.Tensor) -> torch.Tensor:
    """(B, G, G, C) → (B·nW, N, C)."""
    b, g, _, c = x.shape
    x = x.view(b, g // WINDOW, WINDOW, g // WINDOW, WINDOW, c)  # (B, gh, w, gw, w, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, N, c)


def _unwindows(x: torch.Tensor) -> torch.Tensor:
    """(B·nW, N, C) → (B, G, G, C)."""
    per = GRID // WINDOW
    x = x.view(-1, per, per, WINDOW, WINDOW, x.shape[-1])  # (B, gh, gw, w, w, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, GRID, GRID, x.shape[-1])


def shift_mask() -> torch.Tensor:
    """Swin's (nW, N, N) mask after a cyclic shift: 0 between tokens of one region, −100
    between tokens the roll brought together from different ones."""
    regions = torch.zeros(1, GRID, GRID, 1)
    cuts = (slice(0, -WINDOW), slice(-WINDOW, -SHIFT), slice(-SHIFT, None))
    for k, (rows, cols) in enumerate((r, c) for r in cuts for c in cuts):
        regions[:, rows, cols, :] = k
    ids = _windows(regions).squeeze(-1)  # (nW, N)
    diff = ids.unsqueeze(1) - ids.unsqueeze(2)
    return torch.where(diff != 0, -100.0, 0.0)


class WindowAttention(nn.Module):
    """Attention within each window, with Swin's relative position bias and, for a shifted
    layer, the shift mask added on the (B, nW, H, N, N) view of the scores."""

    def __init__(self, shift: bool) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.scale = (DIM // HEADS) ** -0.5
        self.position = nn.Parameter(torch.randn(HEADS, N, N))
        self.register_buffer("mask", shift_mask() if shift else None)

    def forward(self, x):  # (B·nW, N, C)
        rows, n, c = x.shape
        qkv = self.qkv(x).reshape(rows, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B·nW, H, N, d)
        attn = (q * self.scale) @ k.transpose(-2, -1)  # (B·nW, H, N, N)
        attn = attn + self.position.unsqueeze(0)
        if self.mask is not None:
            windows = self.mask.shape[0]
            view = attn.view(rows // windows, windows, HEADS, n, n)  # (B, nW, H, N, N)
            view = view + self.mask.unsqueeze(1).unsqueeze(0)  # + (1, nW, 1, N, N)
            attn = view.view(-1, HEADS, n, n)  # (B·nW, H, N, N)
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(rows, n, c))


class SwinBlock(nn.Module):
    """Norm, cyclic shift, window attention, shift back, residual; then an MLP."""

    def __init__(self, shift: bool) -> None:
        super().__init__()
        self.shift = SHIFT if shift else 0
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = WindowAttention(shift)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):  # (B, G·G, C)
        h = self.norm1(x).view(-1, GRID, GRID, DIM)
        if self.shift:
            h = torch.roll(h, shifts=(-self.shift, -self.shift), dims=(1, 2))
        h = _unwindows(self.attn(_windows(h)))
        if self.shift:
            h = torch.roll(h, shifts=(self.shift, self.shift), dims=(1, 2))
        x = x + h.reshape(x.shape)
        return x + self.mlp(self.norm2(x))


class TinySwin(nn.Module):
    """Blocks over an 8×8 grid of tokens (dynamic batch)."""

    input_names = ("x",)
    output_names = ("y",)

    def __init__(self, shifts) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SwinBlock(shift) for shift in shifts)

    def example_inputs(self, batch, seq, generator):
        return {"x": torch.randn(batch, GRID * GRID, DIM, generator=generator)}

    def dynamic_axes(self):
        return {"x": {0: "batch"}}

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _export(module, path):
    torch.manual_seed(0)
    result = tfgraph.export(module, path, target="ort")
    assert result.passed, result.report["parity"]["outputs"]
    worst = max(o["max_abs_err"] for o in result.report["parity"]["outputs"])
    assert worst < 1e-4, worst
    return result


def test_shifted_window_layer_fuses_with_parity(tmp_path):
    """Exported with tfgraph: the shifted layer fused (an ``ort`` kernel, no softmax left),
    parity with eager within 1e-4 (at batch 1 and 2: the bias takes the rows of each)."""
    result = _export(TinySwin([True]), tmp_path / "out")  # (the mask alone: below)
    attention = result.report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == 1, attention["missed"]
    assert "Softmax" not in op_histogram(ir.load(tmp_path / "out" / "model.onnx"))


def _windowed_graph(view, add="Add", mask_shape=(1, 4, 1, N, N), mask_first=False) -> ir.Model:
    """Q·Kᵀ of 8 rows (2 images × 4 windows), 2 heads, viewed as ``view``, a constant mask
    added (window 0 all zero, the others −100 between the first and last 8 tokens, as a
    shift leaves them), viewed back, softmax, ·V."""
    mask = np.zeros(mask_shape, np.float32)
    dims = ",".join(map(str, mask_shape))
    cross = np.zeros((N, N), np.float32)
    cross[: N // 2, N // 2 :] = cross[N // 2 :, : N // 2] = -100.0
    mask[:, 1:] = cross  # every window but window 0 (by broadcasting over the other axes)
    model = ir.from_onnx_text(f"""
        <ir_version: 10, opset_import: ["" : 20]>
        g (float[8,2,{N},8] q, float[8,2,8,{N}] kt, float[8,2,{N},8] v, float[{dims}] mask)
            => (float[8,2,{N},8] y)
        {{
            view_shape = Constant<value = int64[5] {{{", ".join(map(str, view))}}}>()
            back_shape = Constant<value = int64[4] {{8, 2, {N}, {N}}}>()
            s = MatMul(q, kt)
            viewed = Reshape(s, view_shape)
            summed = {add}({"mask, viewed" if mask_first else "viewed, mask"})
            back = Reshape(summed, back_shape)
            p = Softmax<axis = -1>(back)
            y = MatMul(p, v)
        }}""")
    value = model.graph.inputs.pop()  # the mask: a constant, as Swin's buffer is
    value.const_value = ir.tensor(mask)
    model.graph.register_initializer(value)
    common.ShapeInferencePass()(model)
    FuseAttentionPass()(model)
    return model


@pytest.mark.parametrize("mask_first", [False, True])
def test_shift_mask_is_a_per_row_bias(mask_first):
    """The rule alone: the mask on the (2, 4, H, N, N) view becomes a (8, 1, N, N) bias of the
    scores, row r window r mod 4, which the bias classifier keeps though its row 0 (window
    0, untouched by the shift) is all zero."""
    model = _windowed_graph((2, 4, 2, N, N), mask_first=mask_first)
    (node,) = _attention(model)
    bias = node.inputs[3]
    assert bias.producer().op_type == "Gather" and list(bias.shape[1:]) == [1, N, N]
    ClassifyAttentionBiasPass()(model)
    assert node.inputs[3] is bias and AttentionOp.read(node).bias_kind == "additive"


@pytest.mark.parametrize(
    "view, add, mask_shape, reason",
    [  # the view splits the heads: not a bias of the scores' rows
        ((8, 2, 1, N, N), "Add", (2, 1, N, N), "does not split only their first (batch·window)"),
        ((2, 4, 2, N, N), "Sub", (1, 4, 1, N, N), "not a form the rules know: Sub where the rules"),
    ],
    ids=["heads-split", "subtracted"],
)
def test_refused_view_is_a_readable_miss(view, add, mask_shape, reason):
    """In the fusion report: the rule's reason, never the matcher's raw text."""
    (miss,) = count_fusions(_windowed_graph(view, add, mask_shape))["attention"]["missed"]
    assert miss["reason"].startswith("mask added on a reshaped view of the scores: ")
    assert reason in miss["reason"] and "mismatch" not in miss["reason"], miss


def test_matcher_texts_are_said_in_words():
    said = readable_reason("OpType mismatch: expected Add, got Reshape.")
    assert said == "not a form the rules know: Reshape where the rules expect Add"
    assert "mismatch" not in readable_reason("Attribute axis mismatch: expected 1, got 2.")
    assert readable_reason("the score scale is not a constant scalar") == (
        "the score scale is not a constant scalar"  # a rule's own reason stays
    )


class HFSwin(nn.Module):
    """A Hugging Face Swin at a tiny config: 32×32 images, patches of 2, windows of 4×4
    patches (the second block of each stage shifted by 2), 2 heads, stages of 16 and 4 windows
    (the second stage's 8×8 grid is larger than a window: shifted too). ``DonutSwinModel``
    (also MaskFormer's) adds its mask on the (B, nW, H, N, N) view of the scores (``SwinModel``
    in transformers 5 expands it to (B·nW, 1, N, N) first, and its SDPA path does not trace
    with a dynamic batch: issue 47's fifth class)."""

    input_names = ("pixel_values",)
    output_names = ("last_hidden_state",)

    def __init__(self, kind: str) -> None:
        super().__init__()
        import transformers

        config = getattr(transformers, f"{kind}Config")(
            image_size=32,
            patch_size=2,
            embed_dim=16,
            depths=[2, 2],
            num_heads=[2, 2],
            window_size=4,
            mlp_ratio=2.0,
        )
        torch.manual_seed(0)
        self.swin = getattr(transformers, f"{kind}Model")(config).eval()

    def example_inputs(self, batch, seq, generator):
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=generator)}

    def dynamic_axes(self):
        return {"pixel_values": {0: "batch"}}

    def forward(self, pixel_values):
        return self.swin(pixel_values=pixel_values).last_hidden_state


# slow: a whole Swin (4 layers, 2 stages) traced and exported, about 20 s on a quiet machine
@pytest.mark.slow
def test_hf_donut_swin_fuses_every_layer_with_parity(tmp_path):
    result = _export(HFSwin("DonutSwin"), tmp_path / "swin")
    attention = result.report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == 4, attention["missed"]
