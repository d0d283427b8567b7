"""Hugging Face models whose main input is raw audio into an encoder-decoder (Moonshine,
SpeechEncoderDecoder), mono audio with a channel axis (OmniASR), or a generic ``inputs``
(Perceiver): the main input is chosen from the model (:mod:`tfgraph.sources.huggingface`)."""

import json

import pytest
import torch

import tfgraph
from tfgraph.sources.huggingface import _has_experts, _main_input, hf_source
from tfgraph.tools.coverage import tiny_config

transformers = pytest.importorskip("transformers")

WAV2VEC2 = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "conv_dim": (32, 32),
    "conv_stride": (5, 4),
    "conv_kernel": (10, 4),
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 4,
}


def _speech_encoder_decoder():
    t = transformers
    decoder = t.BertConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        is_decoder=True,
        add_cross_attention=True,
    )
    config = t.SpeechEncoderDecoderConfig.from_encoder_decoder_configs(
        t.Wav2Vec2Config(**WAV2VEC2), decoder
    )
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    torch.manual_seed(0)
    return t.SpeechEncoderDecoderModel(config).eval()


def test_raw_audio_encoder_decoder_exports_with_parity(tmp_path):
    """SpeechEncoderDecoder's ``inputs`` is its Wav2Vec2 encoder's ``input_values``: raw audio
    of any length, beside the decoder's token ids; every attention fuses and parity holds."""
    _speech_encoder_decoder().save_pretrained(tmp_path / "hf")
    result = tfgraph.export(str(tmp_path / "hf"), tmp_path / "a")
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    inputs = {i["name"]: i["shape"] for i in manifest["inputs"]}
    assert inputs == {
        "input_values": ["batch", "samples"],
        "decoder_input_ids": ["batch", "decoder_sequence"],
    }
    report = result.report
    assert report["source"]["main_input"] == "input_values"
    assert report["parity"]["passed"], report["parity"]["outputs"]
    attention = report["fusions"]["attention"]
    assert attention["fused"] == attention["total"] == 6


def test_moonshine_takes_raw_audio_and_decoder_ids():
    """Moonshine's encoder-decoder runs on raw audio: the source's inputs and its eager run."""
    torch.manual_seed(0)
    model = transformers.MoonshineForConditionalGeneration(
        tiny_config("moonshine", "speech-seq2seq")
    )
    source = hf_source(model, origin="test")
    assert source.input_names == ("input_values", "decoder_input_ids")
    assert source.dynamic_axes["input_values"] == {0: "batch", 1: "samples"}
    inputs = source.make_inputs(2, 5, torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(**inputs, use_cache=False).logits
        got = source.module(*(inputs[n] for n in source.input_names))
    torch.testing.assert_close(got, want)


def test_mono_audio_with_a_channel_axis():
    """OmniASR takes (batch, 1, samples): the layout after (batch, samples) fails."""
    torch.manual_seed(0)
    model = transformers.OmniASRForCTC(tiny_config("omniasr_ctc", "speech-encoder"))
    source = hf_source(model, origin="test")
    assert source.input_names == ("input_values",)
    assert source.dynamic_axes["input_values"] == {0: "batch", 2: "samples"}
    inputs = source.make_inputs(2, 5, torch.Generator().manual_seed(0))
    assert inputs["input_values"].shape[:2] == (2, 1)


def test_generic_inputs_named_as_the_forward_takes_them():
    """``inputs``: the encoder's main input, else ``input_ids`` (Perceiver's masked LM)."""
    assert _main_input(_speech_encoder_decoder()) == "input_values"
    perceiver = transformers.PerceiverForMaskedLM(tiny_config("perceiver", "encoder"))
    assert _main_input(perceiver) == "input_ids"


def test_experts_in_a_text_sub_config():
    """Nemotron 3.5 Transcribe's experts are in its text config: batched_mm is chosen."""
    assert _has_experts(tiny_config("nemo_speechlm", "seq2seq-lm"))


def test_probe_feeds_give_raw_audio_frames_worth_of_samples():
    """A mask probe of a dozen samples leaves Moonshine's strided convolutions no frame; the
    samples axis is probed at 400 samples a step (the other axes keep their small sizes)."""
    import onnx

    from tfgraph.passes.probe_feeds import SAMPLES_PER_FRAME, probe_feeds

    audio = onnx.helper.make_tensor_value_info(
        "input_values", onnx.TensorProto.FLOAT, ["batch", "samples"]
    )
    ids = onnx.helper.make_tensor_value_info(
        "ids", onnx.TensorProto.INT64, ["batch", "decoder_sequence"]
    )
    graph = onnx.helper.make_graph([], "g", [audio, ids], [])
    feeds = probe_feeds(graph, 7, False, set())
    assert feeds["input_values"].shape == (2, 9 * SAMPLES_PER_FRAME)  # 7 + 2 per axis before
    assert feeds["ids"].shape == (2, 11)
