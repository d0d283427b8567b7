"""Model objects handed to ``export`` from Python (a notebook): an ``nn.Module``, a module with
its example inputs, or a Hugging Face ``PreTrainedModel``; and the tokenizer given with one.

- A ``PreTrainedModel`` goes to the Hugging Face source (:func:`hf_source`), as a directory
  does: the generic module path would trace its ``forward`` as it is, whose output carries a
  ``DynamicCache`` that torch.export cannot flatten. It is traced in fp32 on the CPU, as a
  directory is loaded: a model in another float type is copied to fp32 (the object is left as
  it is); one on a GPU is refused (``model.cpu()`` first).
- Any other ``nn.Module`` (or ``(module, example_inputs)``) goes to
  :func:`tfgraph.sources.loading.from_module` (:func:`tfgraph.sources.loading.from_object`
  routes them).
- The tokenizer (a transformers tokenizer, a ``tokenizers.Tokenizer``, or a directory of
  tokenizer files) rides on the source and is saved into the artifact's ``tokenizer/``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys

import torch
from torch import nn

from tfgraph.errors import TfgraphError, first_line
from tfgraph.sources.model import ModelSource

logger = logging.getLogger(__name__)


def is_hf_model(obj) -> bool:
    """A transformers ``PreTrainedModel`` (checked without importing transformers)."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(obj, nn.Module):
        return False
    return isinstance(obj, transformers.PreTrainedModel)


def from_hf_object(model, attn_implementation: str | None = None) -> ModelSource:
    """A ``PreTrainedModel`` object as the Hugging Face source (fp32, on the CPU; see the module
    docstring); ``attn_implementation`` is set on it (it computes the same function)."""
    from tfgraph.sources.huggingface import hf_source

    name = type(model).__name__
    devices = {p.device.type for p in model.parameters()}
    if elsewhere := devices - {"cpu", "meta"}:
        raise TfgraphError(
            f"{name} is on {', '.join(sorted(elsewhere))}: export traces and checks it on the "
            "CPU; pass model.cpu() (the target still runs where it runs)"
        )
    if "meta" in devices:
        raise TfgraphError(f"{name} has weights on the meta device: load its weights first")
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes - {torch.float32}:
        logger.warning(
            "%s is in %s: exporting an fp32 copy (the graph is traced in fp32, as a directory "
            "is loaded; precision='fp16'/'bf16' converts the graph after)",
            name,
            ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes - {torch.float32})),
        )
        model = copy.deepcopy(model).float()
    if attn_implementation is not None:
        current = getattr(model.config, "_attn_implementation", None)
        if current != attn_implementation:
            logger.warning("%s: attention implementation set to %s (was %s)",
                           name, attn_implementation, current)  # fmt: skip
            model.set_attn_implementation(attn_implementation)
    source = hf_source(model, origin=f"object:{name}")
    source.info["hf_architecture"] = name
    path = getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
    if path:
        source.info["name_or_path"] = str(path)
    return source


def with_tokenizer(source: ModelSource, tokenizer) -> ModelSource:
    """``source`` carrying ``tokenizer`` (saved into the artifact's ``tokenizer/``); the same
    source when there is none."""
    if tokenizer is None:
        return source
    return dataclasses.replace(source, tokenizer=_tokenizer(tokenizer))


def _tokenizer(tokenizer):
    """A tokenizer that ``save_pretrained`` writes as transformers reads it back."""
    if isinstance(tokenizer, (str, os.PathLike)):
        return _from_directory(os.fspath(tokenizer))
    tokenizers = sys.modules.get("tokenizers")
    if tokenizers is not None and isinstance(tokenizer, tokenizers.Tokenizer):
        import transformers

        return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    if not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TfgraphError(
            f"tokenizer= takes a transformers tokenizer, a tokenizers.Tokenizer or a directory "
            f"of tokenizer files, not a {type(tokenizer).__name__}"
        )
    return tokenizer


def _from_directory(path: str):
    if not os.path.isdir(path):
        raise TfgraphError(f"tokenizer directory '{path}' does not exist")
    try:
        import transformers

        # tokenizer files are data: code they name (auto_map) is never run
        return transformers.AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:  # unreadable tokenizer files are the user's input
        raise TfgraphError(f"cannot load a tokenizer from '{path}' ({first_line(exc)})") from exc
