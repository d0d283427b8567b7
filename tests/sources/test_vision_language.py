"""A vision-language model exported whole (tfgraph/vision_export.py): the tiny random LLaVA of
tfgraph/tools/tiny_vlm.py against Hugging Face's own model and processor.

Default tier (eager, seconds): the tiny directory runs, the two modules the graphs are traced
from give Hugging Face's logits (the merge against ``masked_scatter``). Slow tier: the artifact,
exported once for the module (two Hugging Face traces with parity, ~20 s of CPU): manifest,
fusions, each graph's parity, 16 greedy tokens against ``generate(pixel_values=…,
input_ids=…)``, the CLI and the Python API with an image."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL", reason="processors read images with Pillow")

from tfgraph import contract  # noqa: E402
from tfgraph.tools.tiny_vlm import build, random_image  # noqa: E402

NEW = 16
TEXT = "w1 w7 w3"


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build("llava", tmp_path_factory.mktemp("vlm") / "llava")


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return random_image(tmp_path_factory.mktemp("img") / "random.png", size=24)


@pytest.fixture(scope="module")
def hf(llava, image):
    """Hugging Face's model and processor on the directory, and the prompt's inputs."""
    from PIL import Image

    model = transformers.LlavaForConditionalGeneration.from_pretrained(llava).eval()
    processor = transformers.AutoProcessor.from_pretrained(llava)
    inputs = processor(images=Image.open(image), text=f"<image>\n{TEXT}", return_tensors="pt")
    return model, processor, inputs


@pytest.fixture(scope="module")
def want(hf):
    """Hugging Face's greedy tokens (stopping at EOS, as ours do with the tokenizer's EOS)."""
    model, _, inputs = hf
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="module")
def artifact(llava, tmp_path_factory):
    from tfgraph import export

    return export(llava, tmp_path_factory.mktemp("art") / "out", kv_cache=True)


def test_tiny_llava_runs_eagerly(hf):
    model, processor, inputs = hf
    assert inputs["pixel_values"].shape == (1, 3, 16, 16)  # the processor's small size
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 16  # 4 × 4 patches
    with torch.no_grad():
        assert model(**inputs).logits.shape == (1, inputs["input_ids"].shape[1], 256)


@pytest.mark.slow  # 16 eager greedy steps of Hugging Face's generate: the slow tests' reference
def test_hugging_face_generates_with_the_image(want):
    assert 1 <= len(want) <= NEW


@pytest.mark.slow  # the artifact: two Hugging Face traces with parity (~20 s of CPU)
def test_manifest_names_graphs_roles_and_processor(artifact):
    out, manifest = artifact.out_dir, artifact.manifest
    section = manifest["vision_language"]
    assert section["graphs"] == {"vision": "vision/model.onnx", "decoder": "decoder/model.onnx"}
    assert manifest["files"][0] == "decoder/model.onnx"  # the step graph the runners open
    assert section["image_tokens"] == 16 and section["pixel_shape"] == [3, 16, 16]
    # the CLIP processor resizes every image to one size: none is resized before it
    assert section["input_size"] is None and section["batched"] and section["merge"] == "block"
    assert section["image_processor"]["crop_size"] == {"height": 16, "width": 16}
    vision = manifest["graphs"]["vision/model.onnx"]
    assert [(p["name"], p["role"]) for p in vision["inputs"]] == [
        ("pixel_values", contract.PIXEL_VALUES)
    ]
    assert [p["role"] for p in vision["outputs"]] == [contract.IMAGE_FEATURES]
    decoder = manifest["graphs"]["decoder/model.onnx"]
    roles = {p["role"] for p in decoder["inputs"]}
    assert {contract.TOKEN_IDS, contract.ATTENTION_MASK, contract.IMAGE_FEATURES} <= roles
    assert contract.PAST_KEY in roles and manifest["kv_layout"]["kind"] == "shared"
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["vision_language"]["image_token_id"] == section["image_token_id"] == 255
    assert all((out / f).is_file() for f in manifest["files"])
    assert (out / "processor" / "processor_config.json").is_file()


@pytest.mark.slow  # the artifact: two Hugging Face traces with parity (~20 s of CPU)
def test_attention_fused_in_each_graph(artifact):
    graphs = artifact.report["graphs"]
    for name in ("vision", "decoder"):
        attention = graphs[name]["fusions"]["attention"]
        assert attention["fused"] == attention["total"] == 2, name  # 2 layers run in each
    assert artifact.manifest["fusions"]["attention"] == {"fused": 4, "total": 4}


@pytest.mark.slow  # the artifact: two Hugging Face traces with parity (~20 s of CPU)
def test_parity_of_each_graph(artifact):
    parity = artifact.report["parity"]
    assert artifact.passed
    assert parity["graphs"]["vision"]["passed"]
    decoder = parity["graphs"]["decoder"]
    assert decoder["passed"] and decoder["decode"]["cases"] > 0 and decoder["prefill"]["passed"]


def test_eager_modules_compute_hugging_face_model(llava, hf):
    """The two modules the graphs are traced from, joined, give Hugging Face's logits on the
    processor's inputs: the merge against ``masked_scatter``, the features against
    ``get_image_features``."""
    from tfgraph.sources.vision_language import load_vision_language

    model, _, inputs = hf
    vlm = load_vision_language(llava)
    with torch.no_grad():
        features = vlm.vision.module(inputs["pixel_values"])
        want_features = model.get_image_features(pixel_values=inputs["pixel_values"])
        ours = vlm.decoder.module(inputs["input_ids"], inputs["attention_mask"], features)
        want = model(**inputs).logits
    torch.testing.assert_close(features[0], want_features.pooler_output[0])
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-4)
    assert vlm.image_tokens == 16 and vlm.image_token_id == model.config.image_token_id


def test_merge_reads_one_block_and_no_features():
    from tfgraph.sources.vlm_graphs import merge_image_features

    embeds = torch.zeros(2, 5, 3)
    ids = torch.tensor([[9, 7, 7, 7, 1], [7, 7, 1, 2, 7]])  # 7: the image token
    features = torch.arange(1.0, 7.0).reshape(1, 2, 3).repeat(2, 1, 1)  # rows 1 … 2
    merged = merge_image_features(embeds, ids, features, 7)
    assert merged[0, :, 0].tolist() == [0, 1, 4, 0, 0]  # a third image token: no feature left
    assert merged[1, :, 0].tolist() == [1, 4, 0, 0, 0]  # a token after the block: embedded
    empty = merge_image_features(embeds, ids, features[:, :0], 7)  # decoding steps: no image
    assert torch.equal(empty, embeds)


def test_vision_graph_takes_the_options_but_the_cache():
    """``--kv-dtype int8``, ``--kv-layout``, ``--static-axes`` concern the decoder's cache and
    token axis: the vision graph is exported with their defaults, the rest as asked."""
    from tfgraph.options import ExportOptions
    from tfgraph.vision_export import _vision_options

    asked = ExportOptions(kv_cache=True, kv_dtype="int8", weights="int4", precision="fp16")
    vision = _vision_options(asked)
    assert (vision.kv_cache, vision.kv_dtype, vision.weights) == (False, "fp32", "int4")
    assert vision.precision == "fp16" and vision.target == asked.target


@pytest.mark.slow  # the artifact: two Hugging Face traces with parity (~20 s of CPU)
def test_vision_graph_computes_its_module(hf, artifact, llava):
    from tfgraph.runtime import open_runner
    from tfgraph.sources.vision_language import load_vision_language

    _, _, inputs = hf
    with torch.no_grad():
        want = load_vision_language(llava).vision.module(inputs["pixel_values"])
    vision = open_runner(artifact.out_dir / "vision")
    got = vision.run({"pixel_values": inputs["pixel_values"].numpy()})["image_features"]
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # the artifact: two Hugging Face traces with parity (~20 s of CPU)
def test_greedy_tokens_equal_hugging_face(hf, want, artifact, image):
    from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner
    from tfgraph.runtime.vision_language import ImagePrompts

    _, _, inputs = hf
    prompts, extra = ImagePrompts(artifact.out_dir).prepare([TEXT], [image])
    assert prompts == inputs["input_ids"].tolist()  # the image token placed as HF's processor
    decoder = CachedDecoder(open_runner(artifact.out_dir))
    config = GenerationConfig(max_new_tokens=NEW, eos_token_id=2)
    assert generate(decoder, prompts, config, extra=extra).tokens == [want]


@pytest.mark.slow  # the artifact: two Hugging Face traces with parity (~20 s of CPU)
def test_cli_generate_with_image(hf, want, artifact, image, capsys):
    from tfgraph.cli import main

    _, processor, _ = hf
    argv = ["generate", str(artifact.out_dir), "--image", str(image), "--text", TEXT]
    code = main([*argv, "--max-new-tokens", str(NEW), "--eos-token-id", "2"])
    assert code == 0
    assert capsys.readouterr().out.splitlines() == [f"[0] {processor.tokenizer.decode(want)}"]


@pytest.mark.slow  # the artifact: two Hugging Face traces with parity (~20 s of CPU)
def test_python_api_with_and_without_image(hf, want, artifact, image):
    import tfgraph

    model, processor, _ = hf
    loaded = tfgraph.load(artifact.out_dir)
    text = processor.tokenizer.decode(want, skip_special_tokens=True)
    assert loaded.generate(TEXT, max_new_tokens=NEW, image=image) == text
    ids = processor.tokenizer(TEXT, return_tensors="pt")["input_ids"]  # no image: text alone
    with torch.no_grad():
        alone = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert loaded.generate(ids[0].tolist(), max_new_tokens=4) == alone[0, ids.shape[1] :].tolist()


@pytest.mark.slow  # the artifact: two Hugging Face traces with parity (~20 s of CPU)
def test_parity_recheck_of_each_graph(artifact):
    """``python -m tfgraph parity DIR`` re-checks the decoder (the artifact's step graph),
    ``DIR/vision`` the vision graph, each against the module its report names."""
    from tfgraph.verify.recheck import recheck

    vision = artifact.out_dir / "vision"
    for where, output in ((artifact.out_dir, "logits"), (vision, "image_features")):
        parity = recheck(where, bisect_failures=False)["parity"]
        assert parity["passed"] and parity["outputs"][0]["name"] == output


@pytest.mark.slow  # a second export (int4 weights in both graphs, ~25 s of CPU)
def test_int4_weights_export_and_generate(llava, image, tmp_path):
    """``--weights int4``: both graphs quantized, parity by the quantized rule, the greedy
    error measured with the image features, and generation with an image runs."""
    from tfgraph import export, load

    result = export(llava, tmp_path / "int4", kv_cache=True, weights="int4")
    assert result.passed and result.report["weights"]["error_vs_fp32"]["greedy_tokens"] > 0
    vision = json.loads((tmp_path / "int4" / "vision" / "report.json").read_text())
    assert vision["weights"] is not None and vision["parity"]["passed"]
    text = load(tmp_path / "int4").generate(TEXT, 4, image=image, ignore_eos=True)
    assert 1 <= len(text.split()) <= 4  # words w… (a special token among them is skipped)


@pytest.mark.slow  # a third export (fp16, ~25 s of CPU)
def test_fp16_export_and_generate(llava, image, tmp_path):
    """``--precision fp16``: the decoder's zero row is a weight (converted with the others),
    the fp32 image features are cast to the graph's dtype, the greedy check feeds them."""
    from tfgraph import export, load

    result = export(llava, tmp_path / "fp16", kv_cache=True, precision="fp16")
    assert result.passed and result.report["parity"]["greedy"]["tokens"] > 0
    text = load(tmp_path / "fp16").generate(TEXT, 4, image=image, ignore_eos=True)
    assert 1 <= len(text.split()) <= 4  # words w… (a special token among them is skipped)
