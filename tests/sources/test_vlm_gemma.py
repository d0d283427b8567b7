"""Gemma 3's and PaliGemma's graphs (tfgraph/sources/vlm_families/gemma.py): the vision
tower and its projector batched over images, and a decoder whose prompt attends
bidirectionally where Hugging Face's does with ``token_type_ids`` (Gemma 3: each image block;
PaliGemma: the whole prompt, its end a ``prompt_length`` input), against Hugging Face's own
model and processor on tiny random models.

Default tier (eager, seconds): the reach of each token; the vision module gives
``get_image_features``' features and the decoder module the model's logits with
``token_type_ids`` on a left-padded batch (and not the causal-only logits: the mask matters;
PaliGemma's positions 1-based, as its ``generate`` makes them).
Slow tier: the artifact (two traces with parity; the decoder's layers classified
``prompt_block``, so the mask is kept), its greedy tokens against ``generate`` through its own
processor."""

from __future__ import annotations

import numpy as np
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
FAMILIES = ["gemma3", "paligemma"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    model, processor = build_family(request.param, directory, spec_for(request.param))
    processor.tokenizer.padding_side = "left"
    return directory, model, processor, prompt_for(processor, spec_for(request.param))


@pytest.fixture(scope="module")
def vlm(tiny):
    from tfgraph.sources.vision_language import load_vision_language

    return load_vision_language(tiny[0], image_size=IMAGE_HW)


def test_image_tokens_reach_the_end_of_their_block():
    from tfgraph.sources.vlm_families.gemma import image_reach

    ids = torch.tensor([[5, 9, 9, 9, 6, 7], [0, 0, 5, 9, 9, 6]])
    assert image_reach(ids, 9, torch.arange(6)).tolist() == [
        [0, 2, 1, 0, 0, 0],
        [0] * 3 + [1, 0, 0],
    ]
    # a cached step: its indices continue past the cache; a generated image token is causal
    assert image_reach(torch.tensor([[9]]), 9, torch.tensor([6])).tolist() == [[0]]


def _hf_logits(model, model_type: str, inputs: dict) -> torch.Tensor:
    """Hugging Face's logits on ``inputs`` with its generate's positions (PaliGemma's forward
    numbers a left-padded row from its pads: ``prepare_inputs_for_generation`` does not)."""
    if model_type == "paligemma":
        mask = inputs["attention_mask"]
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1) + 1
        inputs = {**inputs, "position_ids": positions}
    return model(**inputs).logits


def test_eager_modules_compute_hugging_face_model(tiny, vlm):
    _, model, processor, prompt = tiny
    image = random_image()
    both = processor(images=[[image], [image]], text=[prompt, prompt + " w4 w5"],
                     padding=True, return_tensors="pt")  # fmt: skip
    assert (both["token_type_ids"] == 0).any()  # the processor marks the bidirectional part
    with torch.no_grad():
        features = vlm.vision.module(both["pixel_values"])
        want = model.model.get_image_features(both["pixel_values"]).pooler_output
    torch.testing.assert_close(features, want)
    ids, mask = both["input_ids"], both["attention_mask"]
    assert mask[0, 0] == 0  # the shorter prompt is padded on the left
    keep = mask.bool()
    model_type = model.config.model_type
    # PaliGemma: each row's prompt ends at the last column (left padding)
    extra = (torch.full((2, 1), ids.shape[1]),) if model_type == "paligemma" else ()
    with torch.no_grad():
        ours = vlm.decoder.module(ids, mask, features, *extra)[keep]
        want = _hf_logits(model, model_type, both)[keep]
        plain = {k: v for k, v in both.items() if k != "token_type_ids"}
        causal = _hf_logits(model, model_type, plain)[keep]
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-4)
    assert (ours - causal).abs().max() > 1e-3  # the bidirectional part changes them


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory):
    from tfgraph import export

    out = tmp_path_factory.mktemp("gemma_out") / "out"
    return export(str(tiny[0]), out, kv_cache=True, image_size=IMAGE_HW)


@pytest.mark.slow  # the artifact: two Hugging Face traces with parity (~35 s of CPU each)
def test_export_passes_parity_and_generates_hugging_faces_tokens(tiny, artifact):
    from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner
    from tfgraph.runtime.vision_language import ImagePrompts

    _, model, processor, prompt = tiny
    assert artifact.passed  # the cached decoder's prefill and decode steps against eager
    settings = artifact.manifest["vision_language"]
    assert settings["vision_inputs"] == ["pixel_values"] and settings["batched"] is True
    for graph in ("vision", "decoder"):
        fusions = settings["fusions"][graph]["attention"]
        assert fusions["fused"] == fusions["total"] == 2, (graph, fusions)
    if model.config.model_type == "paligemma":  # the runtime feeds each row's prompt end
        assert settings["row_inputs"] == {"prompt_length": "prompt_length"}
    assert _bias_kinds(artifact.out_dir / "decoder" / "model.onnx") == ["prompt_block"] * 2
    inputs = processor(images=[[random_image()]], text=[prompt], return_tensors="pt")
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    want = out[0, inputs["input_ids"].shape[1] :].tolist()
    images = ImagePrompts(artifact.out_dir)
    prompts, extra = images.prepare([prompt], [random_image()])
    assert prompts[0] == inputs["input_ids"][0].tolist()
    decoder = CachedDecoder(open_runner(artifact.out_dir))
    # the prefill's logits at every prompt position (a tiny model's greedy tokens may not
    # show the mask): Hugging Face's with token_type_ids, not causal ones (Gemma 3: Hugging
    # Face's without them; PaliGemma: the artifact's with a prompt length of 0)
    ids = np.asarray(prompts)
    got, _ = decoder.step(ids, decoder.empty_cache(1, ids.shape[1]), None, extra)
    with torch.no_grad():
        hf = _hf_logits(model, model.config.model_type, dict(inputs))
        plain = {k: v for k, v in inputs.items() if k != "token_type_ids"}
        causal = _hf_logits(model, model.config.model_type, plain).numpy()
    if "prompt_length" in extra:
        none = {**extra, "prompt_length": np.zeros_like(extra["prompt_length"])}
        causal, _ = decoder.step(ids, decoder.empty_cache(1, ids.shape[1]), None, none)
    np.testing.assert_allclose(got, hf.numpy(), atol=1e-4, rtol=1e-3)
    assert np.abs(got - causal).max() > 1e-3
    config = GenerationConfig(max_new_tokens=NEW, pad_token_id=0)
    assert list(generate(decoder, prompts, config, extra=extra).tokens[0]) == want


def _bias_kinds(path) -> list[str]:
    """The classifier's verdict on each lowered attention of an ONNX file (node metadata)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    kernels = ("MultiHeadAttention", "GroupQueryAttention", "Attention")
    props = [{p.key: p.value for p in n.metadata_props} for n in graph.node if n.op_type in kernels]
    return [p.get("tfgraph.bias_classified") for p in props]
