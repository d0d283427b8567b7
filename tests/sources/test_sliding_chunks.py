"""Longformer's sliding-chunk self-attention (Longformer, LED's encoder) traced as dense banded
attention (tfgraph/sources/sliding_chunks.py): the same result as Hugging Face's chunks, fused
into ``tfgraph.Attention`` with its band kept as a bias, at parity at lengths on and off the
window's multiples; LED cached, decoding at parity and generating what Hugging Face does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import onnx  # noqa: E402
import transformers  # noqa: E402
from ort_run import ort_session  # noqa: E402

import tfgraph  # noqa: E402
from tfgraph.sources import sliding_chunks  # noqa: E402
from tfgraph.sources.huggingface import hf_source  # noqa: E402
from tfgraph.tools.coverage_generation import greedy_vs_hf  # noqa: E402

WINDOW = 8  # one-sided 4: the band binds at the parity lengths (7, 33)
LAYERS = 2


def _longformer(window: int = WINDOW):
    config = transformers.LongformerConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        attention_window=window,
    )
    torch.manual_seed(0)
    return transformers.LongformerForMaskedLM(config).eval()


def _led(window: int = WINDOW):
    config = transformers.LEDConfig(
        vocab_size=512,
        d_model=64,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_encoder_position_embeddings=256,
        max_decoder_position_embeddings=64,
        attention_window=window,
        decoder_start_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.LEDForConditionalGeneration(config).eval()


def _inputs(batch: int, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    if batch > 1:  # padding on both sides, queries and keys both masked
        mask[1, :3] = 0
        mask[0, -2:] = 0
    return ids, mask


def _logits(model, ids, mask, **extra):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **extra).logits


@pytest.mark.parametrize("window", [4, WINDOW, 64])  # 64: the band holds every key
@pytest.mark.parametrize("length", [7, 8, 16, 33])
def test_dense_band_is_the_chunks(window, length):
    ids, mask = _inputs(2, length)
    for model, extra in (
        (_longformer(window), {}),
        (_led(window), {"decoder_input_ids": _inputs(2, 5, seed=1)[0]}),
    ):
        want = _logits(model, ids, mask, **extra)
        with sliding_chunks.substituted(model) as names:
            got = _logits(model, ids, mask, **extra)
        assert len(names) == LAYERS
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        # restored: no instance attribute left behind
        assert not any(
            "forward" in vars(m) or "_pad_to_window_size" in vars(m) for m in model.modules()
        )


def test_band_bias():
    mask = torch.zeros(1, 6)
    mask[0, 5] = -10000.0  # the layer's mask: 0 visible, negative padded
    bias = sliding_chunks.band_bias(mask, 2, torch.float32)[0, 0]
    visible = bias == 0
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    assert torch.equal(visible, ((i - j).abs() <= 2) & (j != 5))
    assert (bias[~visible] == torch.finfo(torch.float32).min).all()


def test_global_attention_is_left_as_is():
    model = _longformer()
    inputs = ("input_ids", "attention_mask", "global_attention_mask")
    with sliding_chunks.substituted(model, inputs) as names:
        assert names == []
        assert not any("forward" in vars(m) for m in model.modules())
    # in eager, global tokens run the original chunks, padded as before
    ids, mask = _inputs(2, 13)
    glob = torch.zeros_like(ids)
    glob[:, 0] = 1
    want = _logits(model, ids, mask, global_attention_mask=glob)
    with sliding_chunks.substituted(model):
        got = _logits(model, ids, mask, global_attention_mask=glob)
    torch.testing.assert_close(got, want)


def _attention_nodes(path):
    graph = onnx.load(str(path / "model.onnx"), load_external_data=False).graph
    return [n for n in graph.node if n.op_type in ("GroupQueryAttention", "MultiHeadAttention")]


def test_longformer_fuses_and_keeps_the_band(tmp_path):
    model = _longformer()
    result = tfgraph.export(hf_source(model, origin="longformer"), tmp_path, target="ort")
    attention = result.report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == LAYERS
    assert result.report["parity"]["passed"], result.report["parity"]
    nodes = _attention_nodes(tmp_path)
    assert len(nodes) == LAYERS
    for node in nodes:  # not causal, the band-and-padding bias an input of the kernel
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs.get("causal", 0) == 0
        assert len(node.input) > 10 and node.input[10]
    # lengths on and off multiples of the window, padded rows, against eager
    session = ort_session(tmp_path / "model.onnx")
    for batch, length in [(1, 7), (2, 8), (2, 16), (3, 33)]:
        ids, mask = _inputs(batch, length, seed=length)
        feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
        got = session.run(None, feeds)[0]
        np.testing.assert_allclose(got, _logits(model, ids, mask).numpy(), atol=1e-4, rtol=1e-3)


# slow: 1 min on LED (architecture coverage); Longformer's fusion test stays
@pytest.mark.slow
def test_led_is_cached_and_generates(tmp_path):
    model = _led()
    model.save_pretrained(tmp_path / "hf")
    plain = tfgraph.export(str(tmp_path / "hf"), tmp_path / "plain", target="ort")
    attention = plain.report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == 3 * LAYERS  # encoder, self, cross
    assert plain.report["parity"]["passed"], plain.report["parity"]
    session = ort_session(tmp_path / "plain" / "model.onnx")
    for length in (8, 16, 17):  # multiples of the window: nothing to unpad
        ids, _ = _inputs(2, length, seed=length)
        dec = _inputs(2, 5, seed=1)[0]
        got = session.run(None, {"input_ids": ids.numpy(), "decoder_input_ids": dec.numpy()})[0]
        with torch.no_grad():
            want = model(input_ids=ids, decoder_input_ids=dec).logits.numpy()
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)

    cached = tfgraph.export(str(tmp_path / "hf"), tmp_path / "cached", kv_cache=True, target="ort")
    attention = cached.report["fusions"]["attention"]
    assert attention["fused"] == attention["total"]
    parity = cached.report["parity"]
    assert parity["passed"] and parity["decode"]["passed"], parity
    tokens = greedy_vs_hf(tmp_path, model, "seq2seq-lm")  # reads tmp_path / "cached"
    assert tokens["tokens_equal"], tokens
