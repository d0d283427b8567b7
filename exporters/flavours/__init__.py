"""Flavours: the artifact laid out for a runtime users already run, besides tfgraph's own.

``--flavour`` (``ExportOptions.flavour``) picks one:

- ``tfgraph`` (default): tfgraph's runtime contract (``manifest.json`` roles, the shared KV
  buffer with its explicit past lengths).
- ``genai``: what onnxruntime-genai's ``og.Model(dir)`` loads (:mod:`.genai`).
- ``optimum``: what Hugging Face Optimum's ``ORTModelForCausalLM`` and transformers.js load
  (:mod:`.optimum`).

A flavour is a :class:`Flavour`: it checks the options before any slow work, may ask the
pipeline for another KV layout, rewrites the graph after the last precision step (a step of
the export's step runner) and writes its own files beside the manifest. tfgraph's runtime
reads every flavour's artifact through the same ``manifest.json``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from tfgraph.errors import TfgraphError

FLAVOURS = ("tfgraph", "genai", "optimum")


@dataclass(frozen=True)
class Flavour:
    """The tfgraph flavour: nothing to check, rewrite or add. Others subclass it."""

    name: str = "tfgraph"
    # the KV layout the pass pipeline builds ("shared": one buffer per layer that past and
    # present share, with explicit past lengths; "concat": a growing past, present = past + new)
    kv_layout: str = "shared"
    model_file: str = "model.onnx"  # where the step graph is saved, relative to the artifact

    def check(self, options, target) -> None:
        """Refuse options this flavour cannot lay out (a one-line :class:`TfgraphError`)."""

    def check_source(self, source) -> None:
        """Refuse a loaded model this flavour cannot describe, before it is traced (a
        one-line :class:`TfgraphError`)."""

    def rewrite(self, graph, source, options, steps) -> None:
        """Rewrite ``graph`` (after precision, weights and the int8 cache) through
        ``steps.run`` so the step is recorded, checked and probed like any pass."""

    def write(self, stage: Path, graph, source, manifest: dict, options) -> list[str]:
        """Write this flavour's files into ``stage`` (after ``manifest.json``'s contents are
        known); return their paths relative to ``stage``."""
        return []


def get_flavour(name: str) -> Flavour:
    """The flavour named ``name``; an unknown name is a one-line error listing them."""
    if name not in FLAVOURS:
        raise TfgraphError(f"--flavour must be one of {', '.join(FLAVOURS)}, not {name!r}")
    if name == "tfgraph":
        return Flavour()
    return importlib.import_module(f"{__name__}.{name}").FLAVOUR
