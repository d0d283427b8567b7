"""``--flavour genai``: an artifact that onnxruntime-genai loads and runs as it is.

``og.Model(dir)`` reads ``genai_config.json`` (:mod:`.genai_config`) and the tokenizer files
beside it; ``og.Generator`` feeds ``input_ids``, ``attention_mask`` and one preallocated KV
buffer per layer, bound as past and present (``past_key_values.N.key`` /
``present.N.key``), right-pads batched prompts and appends a column of ones to the mask at
each step. The graph reads its past lengths off that mask (:mod:`.genai_graph`), so it takes
exactly what genai feeds; the manifest's roles still describe it, and tfgraph's own runtime
(``generate``, in-flight batching, the export's parity check) runs the same files.

Files: tfgraph's (``model.onnx``, ``manifest.json``, ``report.json``, ``tokenizer/``), plus
``genai_config.json`` and a copy of each tokenizer file at the top of the artifact, where
genai reads them (tfgraph reads ``tokenizer/``; a few kilobytes to a few megabytes twice).

genai drives decoder-only models whose cache is GroupQueryAttention's shared buffer, with
per-row past lengths: an encoder-decoder (no encoder pass in genai's decoder-only model), a
model with recurrent state or cached token values (inputs genai does not feed), or one with
an attention layer that is not lowered to GroupQueryAttention (its cache stays copying) is
refused with the reason (:func:`.genai_graph.why_not`). Beam search is not: genai turns the
shared buffer off for beams.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from tfgraph.errors import TfgraphError
from tfgraph.exporters.flavours import Flavour
from tfgraph.exporters.flavours.genai_config import CONFIG_FILE, genai_config, model_config
from tfgraph.exporters.flavours.genai_graph import lengths_from_mask, why_not

# GroupQueryAttention's shared buffer, as genai binds it (ort-cuda's graph is untested with
# genai's CUDA build: not offered yet)
TARGETS = ("ort",)
STEP = "GenaiLengthsFromMaskPass"


@dataclass(frozen=True)
class GenaiFlavour(Flavour):
    """The onnxruntime-genai flavour (module doc)."""

    def check(self, options, target) -> None:
        name = getattr(target, "name", target)
        if not options.kv_cache:
            raise TfgraphError(
                "--flavour genai lays out a KV-cached decoder for onnxruntime-genai: add --kv-cache"
            )
        if name not in TARGETS:
            raise TfgraphError(
                f"--flavour genai needs --target ort (GroupQueryAttention's shared KV buffer, "
                f"which genai binds on the CPU), not {name!r}"
            )
        if options.kv_dtype != "fp32":
            raise TfgraphError(
                "--flavour genai with --kv-dtype int8: genai feeds no KV scales; drop --kv-dtype"
            )
        if options.kv_layout != "shared":
            raise TfgraphError(
                f"--flavour genai with --kv-layout {options.kv_layout}: genai binds one "
                "contiguous buffer per layer; drop --kv-layout"
            )
        if not options.row_lengths:
            raise TfgraphError(
                "--flavour genai reads each row's past length off the attention mask (genai "
                "right-pads batches): drop --no-row-lengths"
            )

    def check_source(self, source) -> None:
        if "attention_mask" not in source.input_names:  # the graph's why_not, before tracing
            raise TfgraphError(
                "--flavour genai: onnxruntime-genai cannot drive this model: it takes no "
                "attention_mask, which genai reads each row's length from; export it without "
                "--flavour genai for tfgraph's runtime"
            )

    def rewrite(self, graph, source, options, steps) -> None:
        why = why_not(graph)
        if why is not None:
            raise TfgraphError(
                f"--flavour genai: onnxruntime-genai cannot drive this model: {why}; export it "
                "without --flavour genai for tfgraph's runtime"
            )
        steps.run(STEP, lambda: lengths_from_mask(graph), graph, exact=None,
                  changed=lambda _: True)  # fmt: skip

    def write(self, stage: Path, graph, source, manifest: dict, options) -> list[str]:
        config = genai_config(graph, manifest, model_config(source))
        (stage / CONFIG_FILE).write_text(json.dumps(config, indent=4) + "\n")
        return [CONFIG_FILE, *_tokenizer_copies(stage)]


def _tokenizer_copies(stage: Path) -> list[str]:
    """The files of ``tokenizer/`` copied to the artifact's top, where genai reads them."""
    folder = stage / "tokenizer"
    if not folder.is_dir():
        return []
    copied = []
    for path in sorted(folder.iterdir()):
        if path.is_file() and not (stage / path.name).exists():
            shutil.copyfile(path, stage / path.name)
            copied.append(path.name)
    return copied


FLAVOUR = GenaiFlavour(name="genai")
