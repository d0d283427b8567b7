"""Mllama exported whole (tfgraph/sources/vlm_families/mllama.py): the vision model and
projector as the vision graph, the text model reading the features by cross-attention in the
decoder, whose cross keys and values the export splits off as the decoder's encoder (run once
per prompt), against Hugging Face's own model and processor on a tiny random model.

Hugging Face initialises the cross-attention layers' tanh gates (and the vision model's
position gates) to zero, so a random model ignores its image: the tiny model has them set
non-zero (its spec's ``fill``), or no test below could tell the image's path from none.

Default tier (eager, seconds): the traced modules give the features Hugging Face's forward
hands its text model and its logits, on a left-padded batch of two images (one with a padding
tile) with text before an image token. Slow tier: the artifact (two traces and the split
encoder, with parity), its greedy tokens against ``generate(pixel_values=…, …)`` through the
artifact's own processor."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL", reason="processors read images with Pillow")

from tfgraph.tools.tiny_vlm_build import IMAGE_HW, build_family, random_image  # noqa: E402
from tfgraph.tools.tiny_vlm_families import spec_for  # noqa: E402

NEW = 8
TEXTS = ["<|image|> w1 w2 w3", "w2 w3 <|image|> w1"]  # the second: text before its image
SIZES = [IMAGE_HW, (32, 96)]  # 2 × 2 tiles; 1 × 3 tiles and a padding tile


def _images():
    return [random_image(0, SIZES[0]), random_image(1, SIZES[1])]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Mllama, its gates at 0.8 (the family's spec: Hugging Face initialises them to
    zero)."""
    directory = tmp_path_factory.mktemp("mllama") / "hf"
    model, processor = build_family("mllama", directory, spec_for("mllama"))
    gates = [p for n, p in model.named_parameters() if n.endswith("gate")]
    assert len(gates) >= 5 and all(float(g.detach().abs().min()) > 0.5 for g in gates)
    processor.tokenizer.padding_side = "left"
    return directory, model, processor


@pytest.fixture(scope="module")
def vlm(tiny):
    from tfgraph.sources.vision_language import load_vision_language

    return load_vision_language(tiny[0], image_size=IMAGE_HW)


def _batch(processor, texts=TEXTS, images=None):
    images = images if images is not None else _images()
    return processor(images=[[i] for i in images], text=texts, padding=True, return_tensors="pt")


def _positions(mask):
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def test_probe_and_graph_inputs(vlm):
    assert vlm.family.vision_inputs == ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")
    patches = vlm.model.model.vision_model.num_patches
    assert vlm.image_tokens == vlm.model.config.vision_config.max_num_tiles * patches
    assert vlm.decoder.input_names[-1] == "image_tiles"
    assert vlm.settings()["row_inputs"] == {"image_tiles": "aspect_ratio_mask"}


def test_eager_modules_compute_hugging_face_model(tiny, vlm):
    """The features are the ``cross_attention_states`` Hugging Face's forward hands its text
    model; the decoder's logits its logits, on a left-padded batch (a padding tile, text
    before the image token: rows that attend no image), positions as ``generate`` gives."""
    _, model, processor = tiny
    inputs = _batch(processor)
    assert inputs["aspect_ratio_mask"][1, 0].tolist() == [1, 1, 1, 0]
    seen = {}

    def keep(_module, _args, kwargs):
        seen["states"] = kwargs["cross_attention_states"]

    mask = inputs["attention_mask"]
    hook = model.model.language_model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            want = model(**inputs, position_ids=_positions(mask)).logits
    finally:
        hook.remove()
    vision = [inputs[n] for n in vlm.family.vision_inputs]
    with torch.no_grad():
        features = vlm.vision.module(*vision)
        tiles = inputs["aspect_ratio_mask"].reshape(2, -1)
        ours = vlm.decoder.module(inputs["input_ids"], mask, features, tiles)
    torch.testing.assert_close(features, seen["states"].reshape(features.shape))
    keep_rows = mask.bool()
    torch.testing.assert_close(ours[keep_rows], want[keep_rows], atol=1e-5, rtol=1e-4)
    # the image reaches the logits: the other image's features change them
    with torch.no_grad():
        swapped = vlm.decoder.module(inputs["input_ids"], mask, features.flip(0), tiles)
    assert (swapped[keep_rows] - ours[keep_rows]).abs().max() > 1e-3


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory):
    from tfgraph import export

    out = tmp_path_factory.mktemp("mllama_out") / "out"
    return export(str(tiny[0]), out, kv_cache=True, image_size=IMAGE_HW)


@pytest.mark.slow  # the artifact: two Hugging Face traces, the encoder split, parity (~25 s)
def test_export_passes_parity_and_generates_hugging_faces_tokens(tiny, artifact):
    import tfgraph
    from tfgraph.errors import TfgraphError
    from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner
    from tfgraph.runtime.vision_language import ImagePrompts

    _, model, processor = tiny
    assert artifact.passed
    assert (artifact.out_dir / "decoder" / "encoder.onnx").is_file()  # cross K/V, once
    assert artifact.manifest["vision_language"]["row_inputs"] == {
        "image_tiles": "aspect_ratio_mask"
    }
    model.generation_config.pad_token_id = 0
    want = []
    for text, image in zip(TEXTS, _images(), strict=True):  # each prompt alone
        inputs = _batch(processor, [text], [image])
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        want.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    images = ImagePrompts(artifact.out_dir)
    prompts, extra = images.prepare(TEXTS, _images())  # one left-padded batch
    assert extra["image_tiles"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    decoder = CachedDecoder(open_runner(artifact.out_dir))
    config = GenerationConfig(max_new_tokens=NEW, pad_token_id=0)
    got = generate(decoder, prompts, config, extra=extra).tokens
    assert [list(row) for row in got] == want
    # a prompt without an image: the cross-attention layers need one (refused, said why)
    with pytest.raises(TfgraphError, match="give an image with each text"):
        tfgraph.load(artifact.out_dir).generate([1, 2, 3], max_new_tokens=2)


@pytest.mark.slow  # the artifact: shared with the test above (module-scoped export)
def test_cli_and_python_api_generate_with_an_image(tiny, artifact, tmp_path, capsys):
    """``generate DIR --image`` and ``tfgraph.load(DIR).generate(image=…)``: Hugging Face's
    tokens (the split encoder is the image's, not a seq2seq prompt's)."""
    import tfgraph
    from tfgraph.cli import main

    _, model, processor = tiny
    image = _images()[1]
    inputs = _batch(processor, [TEXTS[1]], [image])
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    want = out[0, inputs["input_ids"].shape[1] :].tolist()
    text = processor.tokenizer.decode(want, skip_special_tokens=True)
    loaded = tfgraph.load(artifact.out_dir)
    assert loaded.generate(TEXTS[1], image=image, max_new_tokens=4) == text
    image.save(tmp_path / "image.png")
    argv = ["generate", str(artifact.out_dir), "--image", str(tmp_path / "image.png")]
    assert main([*argv, "--text", TEXTS[1], "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"[0] {processor.tokenizer.decode(want)}"


@pytest.mark.slow  # a second export, in fp16 (~50 s of CPU)
def test_fp16_export_passes_parity_and_its_greedy_check(tiny, tmp_path):
    """fp16: parity, and the greedy check against eager fp32 and fp16, whose prompts feed the
    image's features to the decoder's encoder (a check that fed only the step graph's
    per-prompt inputs failed: 'the encoder needs input image_features')."""
    from tfgraph import export

    result = export(str(tiny[0]), tmp_path / "out", kv_cache=True, image_size=IMAGE_HW,
                    precision="fp16")  # fmt: skip
    assert result.passed
    greedy = result.report["parity"]["graphs"]["decoder"]["greedy"]
    assert greedy["tokens"] == 64 and greedy["equal_to_fp16_eager"] >= 60, greedy
