"""Idefics3, SmolVLM and Idefics2 exported whole (tfgraph/sources/vlm_families/idefics.py):
the vision tower over the processor's tiles with their pixel mask, the connector, and the
decoder merging the k-th image token of a row (between tile markers) with feature k, against
Hugging Face's own model and processor on tiny random models.

Default tier (eager, seconds): the vision module gives ``get_image_features``' features and the
decoder module the model's logits on the processor's inputs (a left-padded batch of two
prompts, each with the image). Slow tier: the artifact (two traces with parity), its greedy
tokens against ``generate(pixel_values=…, pixel_attention_mask=…)`` through the artifact's
own processor."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL", reason="processors read images with Pillow")

from tfgraph.tools.tiny_vlm_build import (  # noqa: E402
    IMAGE_HW,
    build_family,
    prompt_for,
    random_image,
)
from tfgraph.tools.tiny_vlm_families import spec_for  # noqa: E402

NEW = 12
FAMILIES = ["idefics3", "smolvlm", "idefics2"]


def _needs(model_type: str) -> None:
    if model_type == "smolvlm":
        pytest.importorskip("num2words", reason="SmolVLM's processor needs num2words")


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    _needs(request.param)
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    model, processor = build_family(request.param, directory, spec_for(request.param))
    processor.tokenizer.padding_side = "left"
    return directory, model, processor, prompt_for(processor, spec_for(request.param))


@pytest.fixture(scope="module")
def vlm(tiny):
    from tfgraph.sources.vision_language import load_vision_language

    return load_vision_language(tiny[0], image_size=IMAGE_HW)


def test_tiles_are_fixed_by_the_probe(tiny, vlm):
    pixels = vlm.probe.inputs["pixel_values"]
    assert pixels.dim() == 5  # (1, tiles, C, H, W): Idefics3's split and global tiles
    assert pixels.shape[1] == (1 if tiny[1].config.model_type == "idefics2" else 5)
    ids = vlm.probe.inputs["input_ids"][0]
    assert int((ids == vlm.image_token_id).sum()) == vlm.image_tokens
    assert vlm.family.merge == "rank" and vlm.family.sized and vlm.family.batched


def test_eager_modules_compute_hugging_face_model(tiny, vlm):
    """Features of two images at once, then the logits of a left-padded batch of two prompts
    (each with the image, different lengths) equal the model's own forward."""
    _, model, processor, prompt = tiny
    image = random_image()
    both = processor(images=[[image], [image]], text=[prompt, prompt + " w4 w5"],
                     padding=True, return_tensors="pt")  # fmt: skip
    pixels, pixel_mask = both["pixel_values"], both["pixel_attention_mask"]
    with torch.no_grad():
        features = vlm.vision.module(pixels, pixel_mask)
        want = model.model.get_image_features(pixels, pixel_mask).pooler_output
    torch.testing.assert_close(features, torch.stack(want))
    ids, mask = both["input_ids"], both["attention_mask"]
    assert mask[0, 0] == 0  # the shorter prompt is padded on the left
    with torch.no_grad():
        ours = vlm.decoder.module(ids, mask, features)
        want = model(**both).logits
    keep = mask.bool()
    torch.testing.assert_close(ours[keep], want[keep], atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory):
    from tfgraph import export

    out = tmp_path_factory.mktemp("idefics_out") / "out"
    return export(str(tiny[0]), out, kv_cache=True, image_size=IMAGE_HW)


@pytest.mark.slow  # the artifact: two Hugging Face traces with parity (~35 s of CPU each)
def test_export_passes_parity_and_generates_hugging_faces_tokens(tiny, artifact):
    from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner
    from tfgraph.runtime.vision_language import ImagePrompts

    _, model, processor, prompt = tiny
    assert artifact.passed
    settings = artifact.manifest["vision_language"]
    assert settings["vision_inputs"] == ["pixel_values", "pixel_attention_mask"]
    assert settings["input_size"] == list(IMAGE_HW) and settings["batched"] is True
    for graph in ("vision", "decoder"):
        fusions = settings["fusions"][graph]["attention"]
        # 2 layers each, and Idefics2's perceiver resampler (3 attentions) in the vision graph
        assert fusions["fused"] == fusions["total"] >= 2, (graph, fusions)
    inputs = processor(images=[[random_image()]], text=[prompt], return_tensors="pt")
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    want = out[0, inputs["input_ids"].shape[1] :].tolist()
    images = ImagePrompts(artifact.out_dir)
    prompts, extra = images.prepare([prompt], [random_image()])
    assert prompts[0] == inputs["input_ids"][0].tolist()
    decoder = CachedDecoder(open_runner(artifact.out_dir))
    config = GenerationConfig(max_new_tokens=NEW, pad_token_id=0)
    assert list(generate(decoder, prompts, config, extra=extra).tokens[0]) == want
