"""Qwen2-VL exported whole (tfgraph/sources/vlm_families/qwen.py): the vision tower over the
processor's flattened patches at a fixed grid, M-RoPE's 3-D positions in the decoder with
``rope_deltas``, against Hugging Face's own model and processor on a tiny random model.

Default tier (eager, seconds): the traced modules give Hugging Face's features and logits on
the processor's inputs, a padded batch with a row without an image included; the positions
against ``get_rope_index``. Slow tier: the artifact (two traces with parity), its greedy tokens
against ``generate(pixel_values=…, image_grid_thw=…)`` through the artifact's own processor."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL", reason="processors read images with Pillow")

from tfgraph.tools.tiny_vlm_build import IMAGE_HW, build_family, random_image  # noqa: E402
from tfgraph.tools.tiny_vlm_families import spec_for  # noqa: E402

NEW = 12
PROMPT = "<|vision_start|><|image_pad|><|vision_end|> w1 w2 w3"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2_vl") / "hf"
    model, processor = build_family("qwen2_vl", directory, spec_for("qwen2_vl"))
    return directory, model, processor


@pytest.fixture(scope="module")
def vlm(tiny):
    from tfgraph.sources.vision_language import load_vision_language

    return load_vision_language(tiny[0], image_size=IMAGE_HW)


def _inputs(processor, texts, images):
    return processor(
        images=images, text=texts, padding=True, return_tensors="pt",
        return_mm_token_type_ids=True,
    )  # fmt: skip


def _deltas(vlm, ids):
    token = vlm.image_token_id
    return torch.tensor([[vlm.mrope.delta if (row == token).any() else 0] for row in ids])


def test_probe_fixes_the_grid_and_the_block_offsets(vlm):
    grid = vlm.probe.inputs["image_grid_thw"][0].tolist()
    merge = vlm.model.config.vision_config.spatial_merge_size
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    assert vlm.image_tokens == t * h * w == vlm.mrope.coords.shape[0]
    assert vlm.mrope.delta == max(h, w) - vlm.image_tokens
    assert vlm.mrope.coords[:, 1].max() == h - 1 and vlm.mrope.coords[:, 2].max() == w - 1
    assert vlm.family.batched is False and vlm.family.sized is True


def test_eager_modules_compute_hugging_face_model(tiny, vlm):
    """Features, then logits of a left-padded batch (a row with the image, a row of text
    only) equal the model's own forward, which computes M-RoPE with ``get_rope_index``."""
    _, model, processor = tiny
    image = random_image()
    one = _inputs(processor, [PROMPT], [image])
    with torch.no_grad():
        features = vlm.vision.module(one["pixel_values"])
        want = model.model.get_image_features(one["pixel_values"], one["image_grid_thw"])
    torch.testing.assert_close(features[0], want.pooler_output[0])
    texts = [PROMPT, "w4 w5"]
    processor.tokenizer.padding_side = "left"
    both = processor(images=[image], text=texts, padding=True, return_tensors="pt",
                     return_mm_token_type_ids=True)  # fmt: skip
    with torch.no_grad():
        want = model(**both).logits
        rows = torch.cat([features, torch.zeros_like(features)])  # row 2 merges nothing
        ids, mask = both["input_ids"], both["attention_mask"]
        ours = vlm.decoder.module(ids, mask, rows, _deltas(vlm, ids))
    keep = mask.bool()
    torch.testing.assert_close(ours[keep], want[keep], atol=1e-5, rtol=1e-4)


def test_positions_equal_get_rope_index(tiny, vlm):
    from tfgraph.sources.vlm_graphs import mrope_positions

    _, model, processor = tiny
    inputs = _inputs(processor, [PROMPT], [random_image()])
    want, deltas = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"],
    )  # fmt: skip
    ids = inputs["input_ids"]
    base = torch.arange(ids.shape[1])[None]
    got = mrope_positions(base, ids, vlm.image_token_id, vlm.mrope.coords, deltas)
    assert torch.equal(got, want)
    # a decoding step after the prompt: its positions continue by the delta, on all axes
    step = mrope_positions(base[:, -1:] + 1, ids[:, -1:] * 0 + 5, vlm.image_token_id,
                           vlm.mrope.coords, deltas)  # fmt: skip
    assert step[:, 0, 0].tolist() == [int(want[0, 0, -1]) + 1] * 3


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory):
    from tfgraph import export

    out = tmp_path_factory.mktemp("qwen_out") / "out"
    result = export(str(tiny[0]), out, kv_cache=True, image_size=IMAGE_HW)
    return result


@pytest.mark.slow  # the artifact: two Hugging Face traces with parity (~35 s of CPU)
def test_export_fuses_passes_parity_and_generates_hugging_faces_tokens(tiny, artifact):
    import tfgraph
    from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner
    from tfgraph.runtime.vision_language import ImagePrompts

    _, model, processor = tiny
    assert artifact.passed
    settings = artifact.manifest["vision_language"]
    assert settings["mrope_delta"] is not None and settings["input_size"] == list(IMAGE_HW)
    assert settings["batched"] is False and settings["vision_inputs"] == ["pixel_values"]
    for graph in ("vision", "decoder"):
        fusions = artifact.manifest["vision_language"]["fusions"][graph]["attention"]
        assert fusions["fused"] == fusions["total"] == 2, (graph, fusions)
    inputs = _inputs(processor, [PROMPT], [random_image()])
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    want = out[0, inputs["input_ids"].shape[1] :].tolist()
    images = ImagePrompts(artifact.out_dir)
    prompts, extra = images.prepare([PROMPT], [random_image()])
    assert prompts[0] == inputs["input_ids"][0].tolist()
    assert extra["rope_deltas"].tolist() == [[settings["mrope_delta"]]]
    decoder = CachedDecoder(open_runner(artifact.out_dir))
    config = GenerationConfig(max_new_tokens=NEW, pad_token_id=0)
    assert list(generate(decoder, prompts, config, extra=extra).tokens[0]) == want
    # the Python API: an image, and a text alone (zero deltas, no features)
    loaded = tfgraph.load(artifact.out_dir)
    assert isinstance(loaded.generate("w1 w2", image=random_image(), max_new_tokens=4), str)
    assert isinstance(loaded.generate("w1 w2", max_new_tokens=4), str)
