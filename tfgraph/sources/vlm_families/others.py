"""Vision-language families: others (filled in by family)."""

from __future__ import annotations

from tfgraph.sources.vlm_families.family import Family

FAMILIES: dict[str, Family] = {}
