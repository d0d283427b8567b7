"""The model source: an eager module plus what tracing and parity need (input names, dynamic
axes, a generator of random inputs at a given batch and sequence length, the roles of its
inputs and outputs). Loading one from a MODEL argument is :mod:`tfgraph.sources.loading`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree

from tfgraph import contract

InputMaker = Callable[[int, int, torch.Generator], dict[str, torch.Tensor]]


@dataclass
class ModelSource:
    """An eager model and the facts needed to trace it and to test the traced graph."""

    module: nn.Module
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    dynamic_axes: dict[str, dict[int, str]]
    make_inputs: InputMaker
    origin: str  # "preset:gpt-tiny", "factory:pkg.mod:fn", "hf:/path", "object:LlamaForCausalLM"
    info: dict = field(default_factory=dict)
    device: str = "cpu"  # where the eager module runs; parity of a GPU engine uses "cuda"
    # what torch.export traces when it is not ``module`` (a checkpoint's model built without
    # weights), and what binds the traced graph's weights then (tfgraph.sources.streamed)
    trace_module: nn.Module | None = None
    binder: object | None = None
    # a tokenizer given with the model (``export(obj, out, tokenizer=…)``): saved into the
    # artifact's ``tokenizer/`` (a Hugging Face directory's own files are copied instead)
    tokenizer: object | None = None
    # the inputs bind to forward's parameters by keyword (example inputs given as a dict whose
    # keys are not forward's first parameters in order): see :func:`bind_inputs`
    keyword_inputs: bool = False

    def arguments(self, inputs: dict[str, torch.Tensor], device: str | None = None):
        """(args, kwargs) that call the module on ``inputs`` (moved to ``device``), each bound
        to the parameter it is named for (:func:`bind_inputs`)."""
        return bind_inputs(self.input_names, inputs, self.keyword_inputs, device)

    def call(self, module: nn.Module, inputs: dict[str, torch.Tensor]):
        """``module`` (this source's module or a copy) run on ``inputs``, on this source's
        device, without gradients; its output as it comes."""
        args, kwargs = self.arguments(inputs, self.device)
        with torch.no_grad():
            return module(*args, **kwargs)

    def save_tokenizer(self, stage: Path) -> list[str]:
        """The tokenizer given with the model, saved with ``save_pretrained`` into
        ``stage/tokenizer``; its files, relative to ``stage`` ([] without one)."""
        if self.tokenizer is None:
            return []
        directory = stage / "tokenizer"
        self.tokenizer.save_pretrained(directory)
        return sorted(p.relative_to(stage).as_posix() for p in directory.rglob("*") if p.is_file())

    def on_device(self, device: str) -> ModelSource:
        """This source with its eager module on ``device`` (a moved copy; inputs follow it and
        outputs come back to the CPU)."""
        if device == self.device:
            return self
        import copy

        module = copy.deepcopy(self.module).to(device).eval()
        return dataclasses.replace(self, module=module, device=device)

    def _run(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> dict:
        flat, _ = _pytree.tree_flatten(self.call(module, inputs))
        flat = [t.cpu() if isinstance(t, torch.Tensor) else t for t in flat]
        return dict(zip(self.output_names, flat, strict=True))

    def inputs(self, batch: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return self.make_inputs(batch, seq, generator)

    def roles(self) -> dict[str, tuple[str, None]]:
        """The role of each input and output (:mod:`tfgraph.contract`): as the module states
        them (``input_roles`` / ``output_roles`` dicts of name → role), else inferred."""
        stated_in = getattr(self.module, "input_roles", None) or {}
        stated_out = getattr(self.module, "output_roles", None) or {}
        probe = self.inputs(1, 2)
        dtypes = {n: str(probe[n].dtype) for n in self.input_names if n in probe}
        roles = contract.infer_input_roles(self.input_names, dtypes)
        roles.update(contract.infer_output_roles(self.output_names))
        roles.update({n: (r, None) for n, r in {**stated_in, **stated_out}.items()})
        return roles

    def eager(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the eager module; outputs flattened and named like the graph outputs."""
        return self._run(self.module, inputs)

    def converted(self, dtype: torch.dtype) -> nn.Module:
        """A copy of the module in ``dtype`` (``module.to(dtype)``, as ``model.half()`` does),
        made once."""
        copies = self.__dict__.setdefault("_low_copies", {})
        if dtype not in copies:
            import copy

            copies[dtype] = copy.deepcopy(self.module).to(dtype).eval()
        return copies[dtype]

    def eager_in(self, inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
        """The eager module run in ``dtype`` (``torch.float16``, ``torch.bfloat16``): the
        :meth:`converted` copy on the inputs with floats cast; outputs as they come."""
        if dtype == torch.float32:
            return self.eager(inputs)
        cast = {n: v.to(dtype) if v.is_floating_point() else v for n, v in inputs.items()}
        return self._run(self.converted(dtype), cast)


def bind_inputs(
    names: tuple[str, ...], inputs: dict, keyword: bool, device: str | None = None
) -> tuple[tuple, dict]:
    """(args, kwargs) for ``module(*args, **kwargs)``: the inputs ``names`` in order, by
    position, or by keyword when ``keyword`` (a dict of example inputs that skips or reorders
    forward's parameters: ``{"x": …, "mask": …}`` for ``forward(x, pos=None, mask=None)``
    must not land the mask in ``pos``)."""
    values = {n: inputs[n] if device is None else inputs[n].to(device) for n in names}
    if keyword:
        return (), values
    return tuple(values.values()), {}


# Hugging Face config attributes that state the most positions a model takes.
_HF_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_sequence_length")


def max_positions(config) -> int | None:
    """The most positions (past + new tokens) a model supports, when its config says: a zoo
    model's learned position table (``max_seq_len``; its other position schemes have no limit),
    a Hugging Face config's ``max_position_embeddings`` / ``n_positions``. ``None`` otherwise."""
    from tfgraph.models import ModelConfig

    if isinstance(config, ModelConfig):
        return config.max_seq_len if config.positions == "learned" else None
    configs = [config]
    try:  # an encoder-decoder of two configs (EncoderDecoderModel): the decoder's limit
        configs.append(config.get_text_config(decoder=True))
    except Exception:  # noqa: BLE001 - not a transformers config
        pass
    for cfg in configs:
        for attr in _HF_POSITION_LIMITS:
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
