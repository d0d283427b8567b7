"""A vision-language checkpoint streamed, as a text decoder's is (:mod:`.streamed`): neither
graph needs the model in memory.

- **The eager reference** of both graphs is one streamed model (accelerate's disk offload from
  the checkpoint's own shards, fp32): the vision tower, the projector and each decoder layer
  load their weights when they run and drop them after. The probe, the features' shape and
  what a family records from an eager run (Qwen2-VL's grid tables) come from it.
- **The traced model** is the same model built without weights (parameters on uninitialized
  CPU storage that nothing reads); both graphs' initializers come out named by their
  parameter names and are bound lazily to the checkpoint's tensors (:class:`WeightBinder`), the
  vision tower's as the decoder's.

Each graph's wrapper class is rebuilt around another model by ``cls(model, output_name)``
(what the int4 reference does: :mod:`tfgraph.exporters.ort.weights.streamed_reference`), so
each source's module is an instance of a subclass that closes over the family and probe.

A checkpoint whose tensors transformers renames or computes as it loads (or whose streamed
model does not run) is loaded whole, as before, with a warning saying why.
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from tfgraph.errors import first_line
from tfgraph.sources.checkpoint import Checkpoint, MissingTensor, loading_whole
from tfgraph.sources.streamed import (
    Streamed,
    WeightBinder,
    empty_model,
    prepare_trace,
    reads_outside,
)
from tfgraph.sources.vlm_graphs import VisionFeatures

logger = logging.getLogger(__name__)


class _Holder(nn.Module):
    """The traced model as ``model``: the parameter names both graphs' wrappers give it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


class _NotStreamable(Exception):
    """A graph's wrapper whose parameter names are not ``model.`` + the model's."""


def _rebuildable(module: nn.Module, build, name: str) -> nn.Module:
    """``module`` as an instance of a subclass of its class whose ``cls(model, output)``
    builds the same wrapper around ``model`` (``build(model)``), each reading the weights its
    code takes outside a unit's forward (:func:`_reading`)."""

    def rebuild(cls, *args, **_kwargs):
        if not args:  # copy.deepcopy (an fp16 reference's copy) makes the object bare
            return object.__new__(cls)
        return _reading(build(args[0]))  # not an instance of cls: no __init__ again

    cls = type(name, (type(module),), {"__new__": rebuild})
    module.__class__ = cls
    return _reading(module)


def _reading(wrapper: nn.Module) -> nn.Module:
    """A graph's wrapper calls the streamed model's parts directly (the tower, the
    projector, the embeddings), not its forward, where the model's own hook reads a weight
    taken outside its module's forward (LLaVA-NeXT's ``image_newline``, BLIP-2's query
    tokens): the wrapper's forward runs under the same read."""
    mode = getattr(getattr(wrapper, "model", None), "tfgraph_reads", None)
    if mode is not None:
        reads_outside(wrapper, wrapper.model, mode)
    return wrapper


def streamed_vision_language(build, cls, config, path: Path, extra: dict, image_size=None):
    """The :class:`~tfgraph.sources.vision_language.VisionLanguage` of the safetensors
    directory ``path`` streamed (module doc); (None, why) when it cannot stream. ``build``:
    that class, handed in by its module (which imports this one: no import circle)."""
    checkpoint = Checkpoint(path)  # a missing or truncated shard is refused here
    # saved in the older layout (``language_model.model.…``): transformers' renamings chained
    checkpoint.chained_renamings = True
    logger.info("streaming %s from %s (%s)", cls.__name__, path, checkpoint.dtypes())
    streamed = Streamed(cls, config, extra, checkpoint)
    try:
        eager = streamed.model()
        try:
            with eager.tfgraph_reads():  # the probe's eager runs call the model's parts
                vlm = build(eager, path, image_size)
        except (RuntimeError, NotImplementedError, TypeError, AttributeError) as exc:
            # the streamed model does not run (a weight read where no hook loads it, as
            # Mllama's tower does): as a text decoder that cannot stream, loaded whole
            raise _NotStreamable(f"its streamed model does not run: {first_line(exc)}") from exc
        holder = _Holder(empty_model(cls, config, extra))
        prepare_trace(holder, checkpoint)  # CPU storage: a family may run the tower once on it
        trace = holder.model
        family, probe = vlm.family, vlm.probe
        vision = VisionFeatures(trace, family, probe).eval()
        decoder = vlm.decoder_module(trace)
        # fresh storage again: what that eager run touched is handed back, nothing resident
        binder = prepare_trace(holder, checkpoint)
        for module in (vision, decoder, vlm.vision.module, vlm.decoder.module):
            if getattr(module, "model", None) not in (trace, vlm.model):
                raise _NotStreamable(f"{type(module).__name__} holds the model not as 'model'")
    except _NotStreamable as exc:  # its weights would not be bound by their names
        logger.warning("%s cannot stream (%s): loading it whole", path, exc)
        return None, str(exc)
    except MissingTensor as exc:
        return None, loading_whole(path, exc)
    binder.streamed = streamed
    _bind(vlm, vision, decoder, binder, checkpoint)
    return vlm, None


def _bind(vlm, vision: nn.Module, decoder: nn.Module, binder: WeightBinder, checkpoint) -> None:
    """Both sources traced from the weightless model, bound lazily, their eager modules
    rebuildable around the int4 reference's model."""
    family, probe = vlm.family, vlm.probe
    _rebuildable(
        vlm.vision.module,
        lambda model: VisionFeatures(model, family, probe).eval(),
        "StreamedVisionFeatures",
    )
    _rebuildable(vlm.decoder.module, vlm.decoder_module, "StreamedMergedDecoder")
    stored = checkpoint.dtypes()
    for source, traced in ((vlm.vision, vision), (vlm.decoder, decoder)):
        source.trace_module, source.binder = traced, binder
        source.info["checkpoint_dtype"] = max(stored, key=stored.get) if stored else None
        source.info["checkpoint_bytes"] = checkpoint.nbytes
        source.info["eager_reference"] = (
            "streamed (accelerate disk offload from the checkpoint), fp32"
        )
