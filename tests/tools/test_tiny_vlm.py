"""Tiny vision-language models of many families (``tfgraph.tools.tiny_vlm_build``): each built
from its own config class made tiny and its own processor class over a generated tokenizer
(no download), then Hugging Face ``generate`` greedy on ``processor(images=random image,
text=prompt)``; and the coverage matrix's ``vision-language`` kind over transformers'
image-text-to-text mapping."""

import json

import pytest

from tfgraph.cli import main
from tfgraph.tools import coverage, coverage_report, coverage_vlm, tiny_vlm
from tfgraph.tools.tiny_processors import sync_token_ids, word_tokenizer
from tfgraph.tools.tiny_vlm_build import NEW_TOKENS, build_family, eager_generate
from tfgraph.tools.tiny_vlm_families import VERIFIED, spec_for

pytest.importorskip("transformers")


def _image_token_id(config) -> int:
    for name in ("image_token_id", "image_token_index"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    raise AssertionError("no image token id in the config")


# LLaVA (CLIP tower, the <image> placeholder expanded per patch), Qwen2-VL (dynamic
# resolution, M-RoPE's 3-D positions found from <|vision_start|>), Gemma 3 (SigLIP, pooled
# soft tokens between <start_of_image> and <end_of_image>): about a second each
@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl", "gemma3"])
def test_family_builds_tiny_and_generates_eagerly(model_type, tmp_path):
    model, processor = build_family(model_type, tmp_path / model_type, spec_for(model_type))
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    assert (tmp_path / model_type / "config.json").is_file()
    saved = list((tmp_path / model_type).glob("*processor*.json"))
    assert saved, "the processor was not saved beside the model"
    inputs, tokens = eager_generate(model, processor, spec_for(model_type))
    assert len(tokens) == NEW_TOKENS and all(0 <= t < 512 for t in tokens)
    # the processor expanded the placeholder to the model's image tokens (by the same id)
    image_id = _image_token_id(model.config)
    assert processor.tokenizer.convert_ids_to_tokens(image_id) != processor.tokenizer.unk_token
    assert int((inputs["input_ids"] == image_id).sum()) > 1


def test_token_ids_follow_the_generated_tokenizer():
    """The config's ``<name>_index`` fields take the ids of the tokenizer's tokens of the same
    name: a tiny vocabulary has none of the checkpoint's ids (Gemma 3's 262144)."""
    import transformers

    config = transformers.Gemma3Config()
    tokenizer = word_tokenizer({"image_token": "<img>", "boi_token": "<boi>", "eoi_token": "<eoi>"})

    class Processor:
        pass

    processor = Processor()
    processor.tokenizer = tokenizer
    done = sync_token_ids(config, processor)
    assert done == {
        "image_token_index": tokenizer.convert_tokens_to_ids("<img>"),
        "boi_token_index": tokenizer.convert_tokens_to_ids("<boi>"),
        "eoi_token_index": tokenizer.convert_tokens_to_ids("<eoi>"),
    }
    assert config.image_token_index == tokenizer.image_token_id < 512
    assert config.text_config.pad_token_id != config.image_token_index  # specials untouched


def test_vision_language_kind_lists_every_image_text_to_text_model():
    from transformers.models.auto import modeling_auto

    rows = coverage.architectures(kinds=["vision-language"])
    mapping = modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    assert {r[0] for r in rows} == set(mapping) and len(rows) == len(mapping)
    both = {(m, k) for m, k, _ in coverage.architectures(only=["gemma3"])}
    # measured twice: its text decoder (claimed as before) and the whole VLM
    assert both == {("gemma3", "causal-lm"), ("gemma3", "vision-language")}


def test_vision_language_rows_have_their_own_section_and_summary():
    rows = [
        {"model_type": "gpt2", "kind": "causal-lm", "status": "exported", "attention": [2, 2]},
        {"model_type": "llava", "kind": "vision-language", "status": "exported",
         "tokens_equal": True, "image_tokens": 16},
        {"model_type": "x_vl", "kind": "vision-language", "status": "not built",
         "reason": "ValueError: no processor"},
    ]  # fmt: skip
    data = {"rows": rows, "summary": coverage_report.summarize(rows[:1])}
    text = coverage_report.markdown(data)
    main_table, section = text.split("## Vision-language models")
    assert "| llava |" not in main_table and "| gpt2 |" in main_table
    assert "| llava | " in section and "ValueError: no processor" in section
    summary = coverage_vlm.summarize(rows[1:])
    assert (summary["eager"], summary["complete"]) == (1, 1)
    assert summary["by_status"] == {"exported": 1, "not built": 1}
    failing = {**rows[1], "parity": False}  # tokens equal, but the artifact fails its parity
    assert not coverage_vlm.complete(failing) and coverage_vlm.complete(rows[1])


def test_unknown_kind_is_refused_in_one_line(capsys):
    assert main(["coverage", "--kind", "vision-lang", "--list"]) != 0
    err = capsys.readouterr().err
    assert "unknown kind vision-lang" in err and "vision-language" in err


# slow: every family of the table built and run eagerly (a second or two each)
@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(set(VERIFIED) | set(tiny_vlm.BUILDERS)))
def test_every_family_builds_and_generates(model_type, tmp_path):
    if model_type == "smolvlm":
        pytest.importorskip("num2words", reason="SmolVLM's processor needs num2words")
    tiny_vlm.build(model_type, tmp_path / "table")  # the table's entry writes a directory
    assert (tmp_path / "table" / "config.json").is_file()
    model, processor = build_family(model_type, tmp_path / "hf", spec_for(model_type))
    inputs, tokens = eager_generate(model, processor, spec_for(model_type))
    assert len(tokens) == NEW_TOKENS
    assert int((inputs["input_ids"] == _image_token_id(model.config)).sum()) >= 1


# slow: two rows of the matrix in their own processes (build, eager, export when it exists)
@pytest.mark.slow
def test_coverage_vision_language_rows(tmp_path):
    argv = ["coverage", "--out", str(tmp_path), "--only", "llava,gemma3"]
    assert main([*argv, "--kind", "vision-language"]) == 0
    data = json.loads((tmp_path / "coverage.json").read_text())
    assert {(r["model_type"], r["kind"]) for r in data["rows"]} == {
        ("llava", "vision-language"),
        ("gemma3", "vision-language"),
    }
    for row in data["rows"]:
        assert coverage_vlm.eligible(row), row
        assert row["status"] == "exported" or row["reason"].startswith(coverage_vlm.NOT_YET), row
    assert "## Vision-language models" in (tmp_path / "COVERAGE.md").read_text()
