"""The vision-language sweep (slow tier): every family tfgraph exports whole, built tiny with
its own processor, exported with the KV cache and run through the artifact's own processor
and vision graph; its greedy tokens against Hugging Face ``generate`` on the same random image
(tfgraph/tools/coverage_vlm.py's row, as ``coverage --kind vision-language`` measures it).
Each family's own file tests its graphs in the default tier (eager, seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL", reason="processors read images with Pillow")

from tfgraph.sources.vlm_families import FAMILIES  # noqa: E402

# the families whose tiny row is exported with Hugging Face's tokens (COVERAGE.md's rows say
# why the other registered ones fail), and the file whose slow tier exports each
EXPORTED = {
    "test_vision_language.py": ("llava",),
    "test_vlm_qwen.py": ("qwen2_vl",),
    "test_vlm_llava_like.py": (
        "video_llava", "llava_next", "llava_next_video", "llava_onevision", "lighton_ocr",
        "pp_chart2table", "got_ocr2", "blip-2", "vipllava", "aya_vision",
    ),
    "test_vlm_idefics.py": ("idefics3", "smolvlm", "idefics2"),
    "test_vlm_others.py": (
        "exaone4_5", "hyperclovax_vision_v2", "lfm3_vl", "ovis2_5", "video_llama_3",
        "cosmos3_edge", "hunyuan_vl", "hy_v4_vl",
    ),
    # built like Qwen2-VL (tfgraph/sources/vlm_families/qwen.py): swept here
    "test_vlm_families.py": (
        "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm46v",
        "glm4v_moe", "glm4v", "paddleocr_vl",
    ),
}  # fmt: skip
SWEPT_HERE = EXPORTED["test_vlm_families.py"]


def test_exported_families_are_registered_and_tested():
    exported = [m for families in EXPORTED.values() for m in families]
    assert len(exported) == len(set(exported)) >= 12
    assert set(exported) <= set(FAMILIES)
    for name, families in EXPORTED.items():  # each file names the families it exports
        text = (Path(__file__).parent / name).read_text()
        assert all(f'"{m}"' in text for m in families), name


@pytest.mark.slow  # a tiny model's two traces with parity each: 30-60 s of CPU per family
@pytest.mark.parametrize("model_type", SWEPT_HERE)
def test_family_exports_whole_with_hugging_faces_tokens(model_type, tmp_path):
    from tfgraph.tools.coverage_vlm import measure_vlm

    row = measure_vlm(model_type, model_type, tmp_path)
    assert row["status"] == "exported", row.get("reason")
    assert row["tokens_equal"], row.get("tokens_reason")
    assert row["image_tokens"] > 1


def test_image_size_is_refused_for_a_model_without_images(tmp_path):
    import tfgraph
    from tfgraph.errors import TfgraphError
    from tfgraph.vision_export import parse_image_size

    with pytest.raises(TfgraphError, match="--image-size sizes a vision-language model"):
        tfgraph.export("gpt-tiny", tmp_path / "out", image_size="32x32")
    assert not (tmp_path / "out").exists()
    assert parse_image_size("40x48") == (40, 48) and parse_image_size("32") == (32, 32)
    assert parse_image_size(None) is None
    with pytest.raises(TfgraphError, match="HEIGHTxWIDTH"):
        parse_image_size("big")
