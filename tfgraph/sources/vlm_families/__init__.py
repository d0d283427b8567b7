"""The vision-language families tfgraph exports whole, by ``model_type``: one module per
family group, each with its ``FAMILIES`` (:class:`.family.Family` entries)."""

from __future__ import annotations

from tfgraph.sources.vlm_families import gemma, idefics, llava, llava_like, mllama, others, qwen
from tfgraph.sources.vlm_families.family import Family

FAMILIES: dict[str, Family] = {
    **llava.FAMILIES,
    **llava_like.FAMILIES,
    **qwen.FAMILIES,
    **idefics.FAMILIES,
    **gemma.FAMILIES,
    **others.FAMILIES,
    **mllama.FAMILIES,
}
