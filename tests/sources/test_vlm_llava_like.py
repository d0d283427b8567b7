"""LLaVA-like families exported whole (tfgraph/sources/vlm_families/llava_like.py): a vision
tower and a projector (Video-LLaVA's image tower, LLaVA-NeXT's and LLaVA-OneVision's tiles at
the probe's size, LightOnOCR's Pixtral encoder, GOT-OCR 2, BLIP-2's Q-Former, ViP-LLaVA's
layers, Aya Vision's tiles merged by rank), against Hugging Face's own model and processor on
tiny random models.

Default tier (eager, seconds each): the vision module's features equal the model's
``get_image_features`` on the processor's inputs, and the decoder module's logits on them equal
the model's forward. Slow tier: each family's artifact (two traces with parity) and its greedy
tokens, through the artifact's own processor, against ``generate``."""

from __future__ import annotations

import pytest
import torch
from tiny_vlms import tiny_vlm_getter

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL", reason="processors read images with Pillow")

from tfgraph.tools.tiny_vlm_build import (  # noqa: E402
    IMAGE_HW,
    eager_generate,
    processor_inputs,
)
from tfgraph.tools.tiny_vlm_families import spec_for  # noqa: E402

FAMILIES = (
    "video_llava",
    "llava_next",
    "llava_next_video",
    "llava_onevision",
    "lighton_ocr",
    "pp_chart2table",
    "got_ocr2",
    "blip-2",
    "vipllava",
    "aya_vision",
)
NEW = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(model_type)``: (directory, model, processor, loaded VLM), built once each."""
    return tiny_vlm_getter(tmp_path_factory)


def _hf_features(model, inputs) -> torch.Tensor:
    """The model's own ``get_image_features`` on the processor's tensors, (tokens, hidden):
    a list per image (LLaVA-NeXT, LightOnOCR) or a tile axis (Aya Vision) flattened."""
    pixels = inputs.get("pixel_values", inputs.get("pixel_values_images"))
    kwargs = {"image_sizes": inputs["image_sizes"]} if "image_sizes" in inputs else {}
    with torch.no_grad():
        out = model.get_image_features(pixel_values=pixels, **kwargs).pooler_output
    parts = out if isinstance(out, (list, tuple)) else [out]
    return torch.cat([p.reshape(-1, p.shape[-1]) for p in parts])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_eager_modules_compute_hugging_face_model(tiny, model_type):
    """On the processor's inputs for an image of the probe's size: the vision module's
    features are the model's, one per image token of the prompt, and the decoder module's
    logits on them are the model's forward."""
    _, model, processor, vlm = tiny(model_type)
    inputs = processor_inputs(processor, spec_for(model_type))
    vision = [inputs[n] for n in vlm.family.vision_inputs]
    with torch.no_grad():
        features = vlm.vision.module(*vision)
    want = _hf_features(model, inputs)
    torch.testing.assert_close(features.reshape(-1, features.shape[-1]), want)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert int((ids == vlm.image_token_id).sum()) == features.shape[1] == vlm.image_tokens
    with torch.no_grad():
        want = model(**inputs).logits
        ours = vlm.decoder.module(ids, mask, features)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-4)


def test_blip2_with_an_encoder_decoder_text_model_is_refused(tiny):
    from tfgraph.errors import TfgraphError
    from tfgraph.sources.vlm_families import FAMILIES as REGISTERED

    _, model, _, vlm = tiny("blip-2")
    model.config.use_decoder_only_language_model = False
    try:
        with pytest.raises(TfgraphError, match="Flan-T5"):
            REGISTERED["blip-2"].features(model, vlm.probe)
    finally:
        model.config.use_decoder_only_language_model = True


@pytest.mark.slow  # each family's artifact: two Hugging Face traces with parity (~30 s of CPU)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_export_generates_hugging_faces_tokens(tiny, model_type, tmp_path):
    from tfgraph import export
    from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner
    from tfgraph.runtime.vision_language import ImagePrompts
    from tfgraph.tools.tiny_vlm_build import prompt_for, random_image

    directory, model, processor, _ = tiny(model_type)
    spec = spec_for(model_type)
    result = export(str(directory), tmp_path / "out", kv_cache=True, image_size=IMAGE_HW)
    assert result.passed
    fusions = result.manifest["vision_language"]["fusions"]["decoder"]["attention"]
    assert fusions["fused"] == fusions["total"] == 2, fusions
    _, want = eager_generate(model, processor, spec, NEW)
    images = ImagePrompts(result.out_dir)
    prompts, extra = images.prepare([prompt_for(images.processor, spec)], [random_image()])
    assert prompts[0] == processor_inputs(processor, spec)["input_ids"][0].tolist()
    decoder = CachedDecoder(open_runner(result.out_dir))
    config = GenerationConfig(max_new_tokens=NEW, pad_token_id=0)
    assert list(generate(decoder, prompts, config, extra=extra).tokens[0]) == want
