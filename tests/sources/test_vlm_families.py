"""The vision-language sweep (slow tier): every family tfgraph exports whole, built tiny with
its own processor, exported with the KV cache and run through the artifact's own processor
and vision graph; its greedy tokens against Hugging Face ``generate`` on the same random image
(tfgraph/tools/coverage_vlm.py's row, as ``coverage --kind vision-language`` measures it).
Each family's own file tests its graphs in the default tier (eager, seconds)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL", reason="processors read images with Pillow")

from tfgraph.sources.vlm_families import FAMILIES  # noqa: E402

# the families whose tiny row is exported with Hugging Face's tokens (COVERAGE.md's rows say
# why the other registered ones fail)
EXPORTED = ("llava", "qwen2_vl", "qwen2_5_vl")


def test_exported_families_are_registered():
    assert set(EXPORTED) <= set(FAMILIES)


@pytest.mark.slow  # a tiny model's two traces with parity each: 30-60 s of CPU per family
@pytest.mark.parametrize("model_type", EXPORTED)
def test_family_exports_whole_with_hugging_faces_tokens(model_type, tmp_path):
    from tfgraph.tools.coverage_vlm import measure_vlm

    row = measure_vlm(model_type, model_type, tmp_path)
    assert row["status"] == "exported", row.get("reason")
    assert row["tokens_equal"], row.get("tokens_reason")
    assert row["image_tokens"] > 1
