"""LLaVA-like families beyond LLaVA 1.5 (a vision tower, a projector, image tokens merged in
one block): filled in by family."""

from __future__ import annotations

from tfgraph.sources.vlm_families.family import Family

FAMILIES: dict[str, Family] = {}
