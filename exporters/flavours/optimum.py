"""The ``optimum`` flavour: an artifact that Hugging Face Optimum's ``ORTModelForCausalLM`` and
transformers.js (``@huggingface/transformers``) load from the directory as it is.

Layout (one for both clients)::

    onnx/model.onnx          the step graph (Optimum's decoder I/O: :mod:`.optimum_io`)
    config.json              the model's Hugging Face config (the model class, layer counts)
    generation_config.json   its generation defaults (bos/eos/pad ids)
    tokenizer.json, tokenizer_config.json, …   the tokenizer, at the root
    manifest.json, tokenizer/  tfgraph's own (its runtime reads the manifest's first file)

- Optimum: ``ORTModelForCausalLM.from_pretrained(dir)`` finds the only ``*.onnx`` below the
  directory (``onnx/model.onnx``: it takes ``subfolder="onnx"`` by itself) and the config at
  the root.
- transformers.js: ``pipeline("text-generation", dir, {dtype: "fp32"})`` reads
  ``onnx/model{suffix}.onnx`` (suffix from ``dtype``: fp32 has none) and the config and
  tokenizer at the root.

An encoder-decoder also gets ``onnx/encoder.onnx`` (tfgraph's encoder, beside its step graph)
and the clients' pair ``onnx/encoder_model.onnx`` + ``onnx/decoder_model_merged.onnx``
(:mod:`.optimum_seq2seq`; Optimum's ``ORTModelForSeq2SeqLM`` and transformers.js's
``text2text-generation`` load those).

The KV cache grows (``kv_layout = "concat"``: the ONNX Runtime target skips the shared
buffer), so past and present are separate tensors, present = past + new, as both clients
carry them. The model must come from Hugging Face (a directory or a ``PreTrainedModel``):
both clients build their model class from ``config.json``'s ``model_type``.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tfgraph.contract import ENCODER_FILE
from tfgraph.errors import TfgraphError
from tfgraph.exporters.flavours import Flavour
from tfgraph.exporters.flavours.optimum_io import lay_out_io, rename_batch_dims
from tfgraph.exporters.flavours.optimum_seq2seq import write_seq2seq_pair

logger = logging.getLogger(__name__)

MODEL_FILE = "onnx/model.onnx"  # transformers.js's default subfolder and name (fp32 suffix "")
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TARGETS = ("ort", "ort-cuda", "onnx")  # what Optimum's and transformers.js's ONNX Runtime run


def hf_model(source):
    """The Hugging Face ``PreTrainedModel`` behind ``source`` (its wrapper's ``model``), or
    None for a source that is not one."""
    for module in (source.module, getattr(source, "trace_module", None)):
        model = getattr(module, "model", module)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "to_dict") and hasattr(config, "model_type"):
            return model
    return None


def _hf_directory(source) -> Path | None:
    origin = source.origin
    if origin.startswith("hf:") and (Path(origin[3:]) / CONFIG_FILE).is_file():
        return Path(origin[3:])
    return None


def model_config(source) -> dict:
    """``config.json``'s contents: a Hugging Face directory's own file, else the model
    object's config; a one-line error for a source without one."""
    directory = _hf_directory(source)
    if directory is not None:
        try:
            config = json.loads((directory / CONFIG_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise TfgraphError(f"cannot read {directory / CONFIG_FILE}: {exc}") from exc
    else:
        model = hf_model(source)
        if model is None:
            raise TfgraphError(
                f"--flavour optimum needs a Hugging Face model (a directory or a "
                f"PreTrainedModel), not {source.origin}: Optimum and transformers.js build "
                "the model class from its config.json"
            )
        config = json.loads(model.config.to_json_string(use_diff=False))
        config.setdefault("architectures", None)
        config["architectures"] = config["architectures"] or [type(model).__name__]
    if not config.get("model_type"):
        raise TfgraphError("--flavour optimum: the model's config.json names no model_type")
    return config


def generation_config(source, config: dict) -> dict:
    """``generation_config.json``'s contents: the directory's or the model's own, else the
    token ids the model config states."""
    directory = _hf_directory(source)
    if directory is not None and (directory / GENERATION_CONFIG_FILE).is_file():
        return json.loads((directory / GENERATION_CONFIG_FILE).read_text())
    model = hf_model(source)
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "to_dict"):
        return generation.to_diff_dict()
    keys = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    return {k: config[k] for k in keys if config.get(k) is not None}


@dataclass(frozen=True)
class OptimumFlavour(Flavour):
    """Optimum's ``ORTModelForCausalLM`` and transformers.js's decoder layout (module
    docstring)."""

    def check(self, options, target) -> None:
        if not options.kv_cache:
            raise TfgraphError(
                "--flavour optimum needs --kv-cache: Optimum and transformers.js feed "
                "past_key_values"
            )
        if target.name not in TARGETS:
            raise TfgraphError(
                f"--flavour optimum runs in the clients' ONNX Runtime: --target "
                f"{' or '.join(TARGETS)}, not {target.name}"
            )
        if options.kv_dtype != "fp32":
            raise TfgraphError(
                f"--flavour optimum keeps the cache in the model's float type (the clients "
                f"allocate it): drop --kv-dtype {options.kv_dtype}"
            )
        if getattr(options, "kv_layout", "shared") == "paged":
            raise TfgraphError("--flavour optimum grows the cache: drop --kv-layout paged")

    def check_source(self, source) -> None:
        model_config(source)  # the clients build the model class from its config.json

    def rewrite(self, graph, source, options, steps) -> None:
        config = model_config(source)
        if config.get("is_encoder_decoder"):  # the clients' pair is written from the saved one
            steps.run("OptimumIOPass", lambda: rename_batch_dims(graph), graph, changed=bool)
        else:
            steps.run("OptimumIOPass", lambda: lay_out_io(graph), graph, changed=bool)

    def write(self, stage: Path, graph, source, manifest: dict, options) -> list[str]:
        config = model_config(source)
        config["use_cache"] = True  # the graph takes and returns the cache
        # transformers.js picks the file by dtype (fp32: onnx/model.onnx, no suffix); its
        # default elsewhere than node's CPU is another file (wasm: q8, model_quantized.onnx)
        config.setdefault("transformers.js_config", {})["dtype"] = "fp32"
        written = [CONFIG_FILE, GENERATION_CONFIG_FILE]
        (stage / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = generation_config(source, config)
        (stage / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
        encoder = str(PurePosixPath(self.model_file).with_name(ENCODER_FILE))
        if encoder in manifest["files"]:
            hidden = config.get("d_model") or config.get("hidden_size")
            written += write_seq2seq_pair(
                stage, encoder, self.model_file, hidden, options.external_data
            )
        tokenizer = [f for f in manifest["files"] if f.startswith("tokenizer/")]
        for file in tokenizer:  # where both clients read it: the root
            shutil.copyfile(stage / file, stage / Path(file).name)
            written.append(Path(file).name)
        if not any(f.endswith("tokenizer.json") for f in tokenizer):
            logger.warning(
                "--flavour optimum: no tokenizer.json in the model's directory; "
                "transformers.js's pipeline() needs one (model.generate with ids does not)"
            )
        return written


FLAVOUR = OptimumFlavour(name="optimum", kv_layout="concat", model_file=MODEL_FILE)
