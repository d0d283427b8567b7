"""The Qwen2-VL-like families of tfgraph/sources/vlm_families/others.py exported whole, each
against Hugging Face's own model and processor on a tiny random model: EXAONE 4.5,
HyperCLOVA X Vision v2, LFM3-VL, Ovis 2.5, VideoLLaMA 3 (1-D positions), Cosmos 3 Edge,
HunYuan-VL, HY-V4-VL (M-RoPE).

Default tier (eager, seconds per family): the traced modules give the model's own
``get_image_features`` and its forward's logits on the processor's inputs. Slow tier: each
artifact (two traces with parity), its greedy tokens through its own processor against
``generate``."""

from __future__ import annotations

import inspect

import pytest
import torch
from tiny_vlms import tiny_vlm_getter

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL", reason="processors read images with Pillow")

from tfgraph.tools.tiny_vlm_build import (  # noqa: E402
    IMAGE_HW,
    eager_generate,
    processor_inputs,
    prompt_for,
    random_image,
)
from tfgraph.tools.tiny_vlm_families import spec_for  # noqa: E402

NEW = 8
ONE_D = ("exaone4_5", "hyperclovax_vision_v2", "lfm3_vl", "ovis2_5", "video_llama_3")
MROPE = ("cosmos3_edge", "hunyuan_vl", "hy_v4_vl")
FAMILIES = ONE_D + MROPE


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each family's tiny directory, model, processor and loaded VLM, built once per module."""
    return tiny_vlm_getter(tmp_path_factory)


def _hf_features(model, inputs) -> torch.Tensor:
    """The model's own image features for the processor's inputs, one image: (1, N, H)."""
    method = model.model.get_image_features
    accepted = inspect.signature(method).parameters
    kwargs = {k: v for k, v in inputs.items() if k in accepted}
    pooled = method(**kwargs).pooler_output
    return torch.cat(list(pooled), 0)[None] if isinstance(pooled, (list, tuple)) else pooled


@pytest.mark.parametrize("model_type", FAMILIES)
def test_eager_modules_compute_hugging_face_model(built, model_type):
    """The vision module's features and the decoder module's logits (its own merge and
    positions, the features handed in) equal the model's ``get_image_features`` and its
    forward on the processor's inputs. Ovis 2.5's features are framed by the indicator
    embeddings its model puts at the image's start and end tokens (``Family.around``)."""
    _, model, processor, vlm = built(model_type)
    assert vlm.family.batched is False and vlm.family.sized is True
    assert (vlm.mrope is not None) == (model_type in MROPE)
    inputs = processor_inputs(processor, spec_for(model_type))
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    with torch.no_grad():
        features = vlm.vision.module(*[inputs[n] for n in vlm.family.vision_inputs])
        want = _hf_features(model, inputs)
        around = vlm.family.around(model) if vlm.family.around else ()
        count = int((ids == vlm.image_token_id).sum())
        assert features.shape == (1, count + len(around), want.shape[-1])
        torch.testing.assert_close(features[:, 1:-1] if around else features, want)
        extra = [torch.tensor([[vlm.mrope.delta]])] if vlm.mrope is not None else []
        ours = vlm.decoder.module(ids, mask, features, *extra)
        logits = model(**inputs).logits
    torch.testing.assert_close(ours, logits, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", MROPE)
def test_positions_equal_get_rope_index(built, model_type):
    """M-RoPE: the decoder's 3-D positions for the prompt equal the model's own."""
    from tfgraph.sources.vlm_graphs import mrope_positions

    _, model, processor, vlm = built(model_type)
    inputs = processor_inputs(processor, spec_for(model_type))
    method = model.model.get_rope_index
    accepted = inspect.signature(method).parameters
    kwargs = {k: v for k, v in inputs.items() if k in accepted and k != "input_ids"}
    want, deltas = method(inputs["input_ids"], **kwargs)
    ids = inputs["input_ids"]
    base = torch.arange(ids.shape[1])[None]
    got = mrope_positions(base, ids, vlm.image_token_id, vlm.mrope.coords, deltas.reshape(-1, 1))
    assert torch.equal(got, want)
    assert int(deltas.flatten()[0]) == vlm.mrope.delta


@pytest.mark.slow  # each family's artifact: two Hugging Face traces with parity (~30-60 s)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_export_generates_hugging_faces_tokens(built, model_type, tmp_path):
    from tfgraph import export
    from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner
    from tfgraph.runtime.vision_language import ImagePrompts

    directory, model, processor, _ = built(model_type)
    spec = spec_for(model_type)
    result = export(str(directory), tmp_path / "out", kv_cache=True, image_size=IMAGE_HW)
    assert result.passed
    settings = result.manifest["vision_language"]
    assert (settings["mrope_delta"] is not None) == (model_type in MROPE)
    assert settings["input_size"] == list(IMAGE_HW) and settings["batched"] is False
    inputs, want = eager_generate(model, processor, spec, NEW)
    images = ImagePrompts(result.out_dir)
    prompts, extra = images.prepare([prompt_for(images.processor, spec)], [random_image()])
    assert prompts[0] == inputs["input_ids"][0].tolist()
    decoder = CachedDecoder(open_runner(result.out_dir))
    config = GenerationConfig(max_new_tokens=NEW, pad_token_id=0)
    assert list(generate(decoder, prompts, config, extra=extra).tokens[0]) == want
