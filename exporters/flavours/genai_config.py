"""``genai_config.json``: what onnxruntime-genai's ``og.Model(dir)`` reads, written from the
artifact's roles (names, layers, KV shapes, heads) and the model's config (token ids,
context length, the search defaults of ``generation_config.json``).

The fields are those the model builder (``python -m onnxruntime_genai.models.builder``)
writes for a decoder-only model with a shared past/present buffer; ``model.type`` is genai's
generic ``decoder`` (its decoder-only model, with no per-architecture special cases: the
graph carries the architecture).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tfgraph import contract
from tfgraph.errors import TfgraphError
from tfgraph.exporters.ort import ops

logger = logging.getLogger(__name__)

CONFIG_FILE = "genai_config.json"
GENAI_TYPE = "decoder"
DEFAULT_CONTEXT = 4096  # a model that states no position limit (genai needs one)
# the builder's search defaults; generation_config.json's values replace them
SEARCH = {
    "diversity_penalty": 0.0,
    "do_sample": False,
    "early_stopping": True,
    "length_penalty": 1.0,
    "min_length": 0,
    "no_repeat_ngram_size": 0,
    "num_beams": 1,  # beams turn the shared buffer off (genai): the graph needs it
    "num_return_sequences": 1,
    "past_present_share_buffer": True,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
}
_FROM_GENERATION = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")


def model_config(source) -> dict:
    """The model's config as a dict: a Hugging Face directory's ``config.json`` (with its
    ``generation_config.json`` under ``"generation"``), or the config a model object carries;
    ``{}`` for a source without one."""
    origin = source.origin
    if origin.startswith("hf:"):
        directory = Path(origin[3:])
        config = _read(directory / "config.json")
        config["generation"] = _read(directory / "generation_config.json")
        return config
    module = source.module
    for holder in (module, getattr(module, "model", None)):
        config = getattr(holder, "config", None)
        if hasattr(config, "to_dict"):
            found = config.to_dict()
            generation = getattr(holder, "generation_config", None)
            found["generation"] = generation.to_dict() if hasattr(generation, "to_dict") else {}
            return found
    return {"generation": {}}


def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def _template(ports, role: str, layers: list[int]) -> str:
    """genai's ``%d`` name pattern of the cache ``ports`` with ``role``: the exporter's names
    (:func:`tfgraph.contract.tensor_name`), checked layer by layer."""
    names = {p.layer: p.name for p in ports if p.role == role}
    if layers != list(range(len(layers))) or any(
        names.get(i) != contract.tensor_name(role, i) for i in layers
    ):
        raise TfgraphError(
            f"--flavour genai: the {role} tensors are not named "
            f"{contract.tensor_name(role, 'N')} for layers 0..N-1; genai finds them by that "
            "pattern"
        )
    return contract.tensor_name(role, "%d")


def _dims(graph) -> tuple[int, int]:
    """(attention heads, hidden size) read off the graph: the first GroupQueryAttention's
    ``num_heads``, and the token embedding's width."""
    heads = next(
        (
            n.attributes.get_int("num_heads")
            for n in graph.graph
            if (n.domain, n.op_type) == (ops.MS_DOMAIN, ops.GROUP_QUERY_ATTENTION)
        ),
        None,
    )
    hidden = None
    token = contract.signature_of(graph).input(contract.TOKEN_IDS)
    for value in graph.graph.inputs:
        if value.name == token.name:
            for use in value.uses():
                table = use.node.inputs[0]
                if use.node.op_type == "Gather" and table is not None and table.shape:
                    hidden = table.shape[-1]
    return heads, hidden


def _token_ids(config: dict) -> tuple:
    """(bos, eos, pad) from the generation config, else the model config; pad defaults to the
    first eos (as the builder does)."""
    generation = config.get("generation") or {}

    def pick(key):
        value = generation.get(key)
        return value if value is not None else config.get(key)

    eos = pick("eos_token_id")
    pad = pick("pad_token_id")
    if pad is None:
        pad = (eos[0] if isinstance(eos, list) and eos else eos) if eos is not None else 0
    return pick("bos_token_id"), eos, pad


def genai_config(graph, manifest: dict, config: dict) -> dict:
    """The ``genai_config.json`` contents for the flavoured ``graph`` (its manifest, the
    model's ``config``)."""
    signature = contract.signature_from_manifest(manifest) or contract.signature_of(graph)
    layers = signature.cache_layers
    past = signature.input(contract.PAST_KEY, layers[0])
    kv_heads, head_size = past.shape[1], past.shape[3]
    logits = signature.output(contract.LOGITS)
    heads, hidden = _dims(graph)
    hidden = config.get("hidden_size") or hidden or heads * head_size
    vocab = logits.shape[-1] if isinstance(logits.shape[-1], int) else config.get("vocab_size")
    context = manifest.get("max_positions") or config.get("max_position_embeddings")
    if not context:
        logger.warning("genai: the model states no position limit; context_length %d",
                       DEFAULT_CONTEXT)  # fmt: skip
        context = DEFAULT_CONTEXT
    bos, eos, pad = _token_ids(config)
    inputs = {
        "input_ids": signature.input(contract.TOKEN_IDS).name,
        "attention_mask": signature.input(contract.ATTENTION_MASK).name,
    }
    if signature.input(contract.POSITION_IDS) is not None:
        inputs["position_ids"] = signature.input(contract.POSITION_IDS).name
    inputs["past_key_names"] = _template(signature.inputs, contract.PAST_KEY, layers)
    inputs["past_value_names"] = _template(signature.inputs, contract.PAST_VALUE, layers)
    outputs = {
        "logits": logits.name,
        "present_key_names": _template(signature.outputs, contract.PRESENT_KEY, layers),
        "present_value_names": _template(signature.outputs, contract.PRESENT_VALUE, layers),
    }
    model = {
        **({"bos_token_id": bos} if bos is not None else {}),
        "context_length": int(context),
        "decoder": {
            "session_options": {
                "log_id": "onnxruntime-genai",
                "provider_options": [],  # the CPU (og.Config adds a provider)
            },
            "filename": manifest["files"][0],
            "head_size": int(head_size),
            "hidden_size": int(hidden),
            "inputs": inputs,
            "outputs": outputs,
            "num_attention_heads": int(heads),
            "num_hidden_layers": len(layers),
            "num_key_value_heads": int(kv_heads),
        },
        **({"eos_token_id": eos} if eos is not None else {}),
        "pad_token_id": pad,
        "type": GENAI_TYPE,
        "vocab_size": int(vocab),
    }
    generation = config.get("generation") or {}
    search = {**SEARCH, "max_length": int(context)}
    search.update({k: generation[k] for k in _FROM_GENERATION if generation.get(k) is not None})
    return {"model": model, "search": dict(sorted(search.items()))}
