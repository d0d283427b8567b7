"""A safetensors checkpoint without its weights in memory: one model to trace, one to run.

- **The traced model** is built under accelerate's ``init_empty_weights`` (parameters on the
  meta device, buffers such as RoPE's ``inv_freq`` real) in fp32, whatever dtype the checkpoint
  is stored in, then given uninitialized CPU storage (address space nobody touches).
  torch.export traces it without reading a weight; its initializers come out named by their
  parameter names, and :class:`WeightBinder` binds each one to a lazy tensor that reads its
  checkpoint tensor (converted to the graph's dtype) only when it is written or looked at.
- **The eager reference** is the same empty model dispatched by accelerate's big-model
  inference: each block the model says must not be split (a decoder layer), and every other
  module that owns parameters, is offloaded to "disk", with an offload index that points into
  the checkpoint's own safetensors files (nothing is copied), so a forward pass loads each
  block's weights, converted to fp32, just before the block runs and drops them after. The
  reference never holds more than one block's weights.
- **Persistent buffers** the checkpoint holds (BART's ``final_logits_bias``) are read into
  both models as ``from_pretrained`` would (:func:`load_buffers`); buffers stay real under
  ``init_empty_weights(include_buffers=False)``, so they would otherwise keep their init value.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Mapping

import onnx_ir as ir
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tfgraph.errors import TfgraphError, first_line
from tfgraph.progress import tick
from tfgraph.sources.checkpoint import Checkpoint
from tfgraph.sources.in_pieces import in_pieces

logger = logging.getLogger(__name__)

PARAMETER = "tfgraph.parameter"  # a bound weight's parameter name (in the traced wrapper)


def empty_model(cls, config, extra: dict) -> nn.Module:
    """``cls`` built from ``config`` in fp32 with parameters on the meta device."""
    import accelerate
    import transformers

    try:
        with accelerate.init_empty_weights(include_buffers=False):
            if cls is transformers.AutoModel or not hasattr(cls, "_from_config"):
                model = transformers.AutoModel.from_config(config, dtype=torch.float32, **extra)
            else:
                model = cls._from_config(config, dtype=torch.float32, **extra)
    except Exception as exc:  # a config the class cannot build is the user's input
        raise TfgraphError(
            f"cannot build {cls.__name__} from its config.json: {first_line(exc, named=True)}"
        ) from exc
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # from_pretrained ties after loading; a tied head is one tensor
    return model.eval()


def checkpoint_keys(model: nn.Module, checkpoint: Checkpoint) -> dict[str, str]:
    """Every parameter name of ``model`` (tied aliases included) → the checkpoint key that holds
    it; shapes checked. A parameter missing from the checkpoint is refused by name."""
    aliases: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
        params[id(param)] = param
    keys: dict[str, str] = {}
    candidates = _key_candidates(model, checkpoint)
    for pid, names in aliases.items():
        key = next((c for n in names for c in candidates(n) if c in checkpoint.entries), None)
        if key is None:
            checkpoint.entry(names[0])  # raises, naming the tensor
        checkpoint.check_shapes({key: tuple(params[pid].shape)})
        for name in names:
            keys[name] = key
    return keys


def _key_candidates(model: nn.Module, checkpoint: Checkpoint):
    """``candidates(name)``: the checkpoint keys that may hold ``model``'s tensor ``name``, the
    likeliest first."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    tied = getattr(model, "_tied_weights_keys", None)
    tied = tied if isinstance(tied, dict) else {}
    renamed = _saved_names(model)
    # transformers' chained renamings, where the caller asks (a VLM saved in the older
    # layout); a text decoder's checkpoint keeps the single renamings above (a key found only
    # by a chain there would change which missing tensor a fused checkpoint is refused by)
    chained = getattr(checkpoint, "chained_renamings", False)
    loaded = _loaded_names(model, checkpoint) if chained else {}

    def prefixed(name: str) -> tuple[str, ...]:
        if prefix and name.startswith(prefix + "."):
            return name, name[len(prefix) + 1 :]  # a base model's checkpoint under its head class
        # a head class's checkpoint (``bert.…``) loaded as its base model
        return (name, f"{prefix}.{name}") if prefix else (name,)

    def candidates(name: str):
        yield from prefixed(name)
        for each in prefixed(name):  # an older layout's names (LayerNorm.gamma), either way
            yield from renamed(each)  # before a tied weight: an untied head has its own tensor
        if name in loaded:  # renamed as transformers loads it (several renamings chained)
            yield loaded[name]
        if name in tied:
            yield from candidates(tied[name])

    return candidates


def _loaded_names(model: nn.Module, checkpoint: Checkpoint) -> dict[str, str]:
    """The model's name of each checkpoint key → that key, by transformers' own renamings of
    the key as it loads it, applied in turn as it applies them (a VLM saved in the older
    layout: ``language_model.model.embed_tokens`` is ``model.language_model.embed_tokens``,
    two renamings chained). Renamings only: a converted tensor (fused experts) is not the
    stored one."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, apply_renamings

        mapping = get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001 - an older transformers, or a model it cannot map
        return {}
    renamings = [r for r in mapping if not isinstance(r, WeightConverter)]
    if not renamings:
        return {}
    out: dict[str, str] = {}
    for key in checkpoint.entries:
        try:
            name = apply_renamings(key, renamings)
        except Exception:  # noqa: BLE001 - a renaming that does not apply to this key
            continue
        if name != key:
            out.setdefault(name, key)
    return out


# a plain name part: ``^embed_out\.`` (a name prefix, dots escaped), or words joined by dots
# that transformers means, and a checkpoint writes, as dots (``LayerNorm.gamma``: BERT-era
# checkpoints); nothing else of a regex
_LITERAL = re.compile(r"^\^?(?:[\w]|\\\.)+\.?$|^\w+(?:\.\w+)+$")


def _saved_names(model: nn.Module):
    """``names(name)``: the names ``name`` has in a checkpoint saved under an older layout, by
    transformers' own renamings of the model's weights on load (GPT-NeoX's ``embed_out`` is
    ``lm_head`` in transformers 5), reversed; only plain renamings of a literal name part."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        mapping = get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001 - an older transformers, or a model it cannot map
        mapping = []
    pairs = []
    for rule in mapping:
        if type(rule).__name__ != "WeightRenaming":
            continue
        sources = getattr(rule, "source_patterns", None) or []
        targets = getattr(rule, "target_patterns", None) or []
        if len(sources) != 1 or len(targets) != 1 or not _LITERAL.match(sources[0]):
            continue
        anchored = sources[0].startswith("^")
        old = sources[0].lstrip("^").replace("\\.", ".")
        pairs.append((anchored, targets[0], old))

    def names(name: str):
        for anchored, new, old in pairs:
            if anchored and name.startswith(new):
                yield old + name[len(new) :]
            elif not anchored and new in name:
                yield name.replace(new, old)

    return names


def load_buffers(model: nn.Module, checkpoint: Checkpoint) -> list[str]:
    """Give ``model``'s persistent floating buffers that the checkpoint holds (BART's
    ``final_logits_bias``) the checkpoint's values, as ``from_pretrained`` does; returns their
    names. A buffer is small and stays real (``init_empty_weights(include_buffers=False)``):
    the trace records it as a constant and the streamed reference keeps it on the CPU, so
    without this both would compute with the value ``__init__`` gave it."""
    persistent = set(model.state_dict(keep_vars=True))
    candidates = _key_candidates(model, checkpoint)
    loaded = []
    for name, buf in list(model.named_buffers()):
        if name not in persistent or not buf.dtype.is_floating_point:
            continue
        key = next((c for c in candidates(name) if c in checkpoint.entries), None)
        if key is None:  # from_pretrained keeps the initialized value too
            continue
        checkpoint.check_shapes({key: tuple(buf.shape)})
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[attr] = checkpoint.tensor(key, buf.dtype).clone()
        loaded.append(name)
    return loaded


class WeightBinder:
    """Binds a traced graph's initializers (named by the wrapper's parameter names) to lazy
    tensors reading ``checkpoint``; ``streamed`` rebuilds the eager reference."""

    def __init__(self, checkpoint: Checkpoint, keys: dict[str, str]) -> None:
        self.streamed: Streamed | None = None
        self.checkpoint = checkpoint
        self.keys = keys

    def bind(self, model: ir.Model) -> int:
        """Replace every initializer of ``model`` that is a parameter by its lazy checkpoint
        tensor; returns how many were bound."""
        bound = 0
        for name, value in model.graph.initializers.items():
            tensor = value.const_value
            if not _is_torch(tensor) or name not in self.keys:
                continue
            key = self.keys.get(name)
            if key is None:
                raise TfgraphError(
                    f"the traced graph has a weight '{name}' that no checkpoint tensor holds; "
                    "report this with the model's config.json"
                )
            dtype = _torch_dtype(value.dtype)
            value.const_value = self.checkpoint.lazy(key, dtype, value_name=name)
            value.const_value.meta[PARAMETER] = name
            bound += 1
        logger.info("bound %d initializers lazily to %s", bound, self.checkpoint.directory)
        return bound


def prepare_trace(wrapper: nn.Module, checkpoint: Checkpoint) -> WeightBinder:
    """Give ``wrapper``'s parameters (its ``model``: an :func:`empty_model`) uninitialized CPU
    storage, which torch.export traces without reading; the binder that replaces them in the
    traced graph by the checkpoint's tensors.

    Uninitialized storage is address space, not memory: pages nobody writes are never
    resident (a 6.7B fp32 model reserves 27 GB and touches none of it). Tracing on the meta
    device instead gives a different graph (extra shape arithmetic around SDPA's reshapes,
    measured), so CPU storage it is."""
    keys = {f"model.{n}": k for n, k in checkpoint_keys(wrapper.model, checkpoint).items()}
    load_buffers(wrapper.model, checkpoint)
    buffers = {n: b.detach().clone() for n, b in wrapper.named_buffers()}
    wrapper.to_empty(device="cpu")
    for name, value in buffers.items():  # to_empty drops buffers too: RoPE's inv_freq back
        owner, _, attr = name.rpartition(".")
        (wrapper.get_submodule(owner) if owner else wrapper)._buffers[attr] = value
    if hasattr(wrapper.model, "tie_weights"):
        wrapper.model.tie_weights()  # to_empty gave each alias of a tied weight its own storage
    return WeightBinder(checkpoint, keys)


def _is_torch(tensor) -> bool:
    return isinstance(getattr(tensor, "raw", None), torch.Tensor)


def _torch_dtype(dtype: ir.DataType) -> torch.dtype:
    return {
        ir.DataType.FLOAT: torch.float32,
        ir.DataType.FLOAT16: torch.float16,
        ir.DataType.BFLOAT16: torch.bfloat16,
    }[dtype]


class Streamed:
    """How to build the streamed eager model of one checkpoint, again when needed (the
    quantized reference is the same model with some weights replaced)."""

    def __init__(self, cls, config, extra: dict, checkpoint: Checkpoint) -> None:
        self.cls, self.config, self.extra, self.checkpoint = cls, config, extra, checkpoint

    def model(self, overrides=None, untie: tuple[str, ...] = ()) -> nn.Module:
        """The streamed model; ``overrides``: a mapping of parameter name → tensor, read (on
        demand, as a module runs) instead of the checkpoint; ``untie``: parameters given their
        own tensor where the model ties them to another (a quantized LM head)."""
        from accelerate import dispatch_model

        model = empty_model(self.cls, self.config, self.extra)
        keys = checkpoint_keys(model, self.checkpoint)
        load_buffers(model, self.checkpoint)
        for name in untie:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            shared = module._parameters[attr]
            module._parameters[attr] = nn.Parameter(
                torch.empty_like(shared, device="meta"), requires_grad=False
            )
        index = {
            name: {
                "safetensors_file": str(self.checkpoint.entry(key).file),
                "weight_name": key,
                "dtype": "float32",
            }
            for name, key in keys.items()
        }
        _large_allocations_unmapped()
        units = _device_map(model)
        with _quiet("accelerate.big_modeling"), warnings.catch_warnings():
            # "some parameters are on the meta device"; a buffer's key is "no submodule"
            warnings.filterwarnings("ignore", "The following device_map keys do not match")
            dispatch_model(
                model,
                units,
                main_device="cpu",
                offload_index=index,
                state_dict=_Weights(keys, self.checkpoint, overrides),
                preload_module_classes=_blocks(model),
            )
        in_pieces(model, keys, self.checkpoint, overrides)
        _tick_blocks(model, [n for n, d in units.items() if d == "disk"])
        _read_outside_forward(model, keys, self.checkpoint, overrides)
        model.tfgraph_streamed = True
        return model.eval()


class _Weights(Mapping):
    """What accelerate's hooks load as each unit runs: ``overrides`` (the quantized
    reference's dequantized weights) first, else the checkpoint's tensor in fp32, read in
    chunks into its converted copy (accelerate's own safetensors read held the stored copy
    beside the converted one: 6.1 GB for a 250k-word bf16 table)."""

    def __init__(self, keys: dict[str, str], checkpoint: Checkpoint, overrides=None) -> None:
        self._keys, self._checkpoint, self._overrides = keys, checkpoint, overrides

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._overrides is not None and name in self._overrides:
            return self._overrides[name]
        return self._checkpoint.tensor(self._keys[name], torch.float32)

    def __contains__(self, name) -> bool:  # Mapping's own would read the tensor
        return name in self._keys or (self._overrides is not None and name in self._overrides)

    def __iter__(self):
        yield from self._keys
        if self._overrides is not None:
            yield from (n for n in self._overrides if n not in self._keys)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _OffloadedReads(TorchFunctionMode):
    """Reads a parameter that is still on the meta device, where an op gets one, from the
    checkpoint for that op alone. A model may read a child's weight outside the child's
    forward, where no offload hook loads it (NeoMME's head multiplies by
    ``unembedding_projection.weight`` and never calls the module); torch computes a CPU tensor
    times a meta tensor without an error, as uninitialized memory (measured: logits of 1e25)."""

    def __init__(self, model: nn.Module, load) -> None:
        super().__init__()
        self.model, self.load = model, load

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _NO_READ and getattr(func, "__name__", "") != "__get__":  # .shape: none
            args = tuple(self._real(a) for a in args)
            kwargs = {k: self._real(v) for k, v in kwargs.items()}
            # a tensor made on a weight's device (WavLM's compute_bias: torch.arange(...,
            # device=rel_attn_embed.weight.device)) goes where the weights run, not to meta;
            # only factories: accelerate's own moves to meta (offloading a used unit) stay
            if func in _FACTORIES and _is_meta_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
        return func(*args, **kwargs)

    def _real(self, value):
        if isinstance(value, (list, tuple)):
            return type(value)(self._real(v) for v in value)
        if not isinstance(value, nn.Parameter) or not value.is_meta:
            return value
        name = next(
            (n for n, p in self.model.named_parameters(remove_duplicate=False) if p is value),
            None,
        )
        return value if name is None else self.load(name)


# what reads no value: accelerate's own hooks ask a meta weight its ``data_ptr`` (tied
# weights) as they load it; materializing it there read the weight a second time (a
# 250k-word vocabulary: 4.1 GB more at the load's peak, measured)
_NO_READ = frozenset({
    torch.Tensor.data_ptr, torch.Tensor.untyped_storage, torch.Tensor.size, torch.Tensor.dim,
    torch.Tensor.numel, torch.Tensor.element_size, torch.Tensor.is_floating_point,
})  # fmt: skip
_FACTORIES = frozenset({
    torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.tensor,
    torch.linspace, torch.eye, torch.rand, torch.randn, torch.randint,
})  # fmt: skip


def _is_meta_device(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "meta"
    return isinstance(value, str) and value == "meta"


def _read_outside_forward(model: nn.Module, keys: dict, checkpoint, overrides) -> None:
    """Each forward pass of the streamed ``model`` runs under :class:`_OffloadedReads`."""

    def load(name: str) -> torch.Tensor:
        if overrides is not None and name in overrides:
            return overrides[name].to(torch.float32)
        return checkpoint.tensor(keys[name], torch.float32)

    reads_outside(model, model, lambda: _OffloadedReads(model, load))


def reads_outside(module: nn.Module, model: nn.Module, mode) -> None:
    """Each forward pass of ``module`` runs under ``mode()``, an :class:`_OffloadedReads` of
    the streamed ``model``; kept on the model as ``tfgraph_reads`` for a wrapper calling its
    submodules directly (a vision-language graph: :mod:`.vlm_streamed`)."""
    modes: list[_OffloadedReads] = []
    model.tfgraph_reads = mode

    def enter(_module, _args):
        modes.append(mode())
        modes[-1].__enter__()

    def leave(_module, _args, _out):
        if modes:
            modes.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


@contextlib.contextmanager
def _quiet(name: str):
    named = logging.getLogger(name)
    level = named.level
    named.setLevel(logging.ERROR)
    try:
        yield
    finally:
        named.setLevel(level)


def _tick_blocks(model: nn.Module, names: list[str]) -> None:
    """Each offload unit (``names``: modules) that runs ticks ``eager blocks`` (a 7B forward
    pass streams 13 GB)."""
    for i, name in enumerate(names):
        module = model.get_submodule(name) if name else model

        def ran(_module, _args, _out, i=i):
            tick("eager blocks streamed", i + 1, len(names))

        module.register_forward_hook(ran)


def _large_allocations_unmapped() -> None:
    """Streaming allocates and frees a layer's weights per block and pass; glibc's dynamic mmap
    threshold then moves those buffers onto the heap, which it does not hand back (measured: a
    7B reference grew by 1.5 GiB over the parity passes). A fixed threshold keeps every buffer
    above 1 MiB in its own mapping, returned to the system when freed."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        ctypes.CDLL(name).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


def _blocks(model: nn.Module) -> list[str]:
    """The classes of the blocks the model says must not be split (its decoder layers): each
    loads all its weights when it runs, not module by module as accelerate does by default,
    since a block may read a child's weights outside the child's forward (JetMoE's attention
    experts add ``experts.bias`` in a method of their own, which no hook sees)."""
    return sorted(set(getattr(model, "_no_split_modules", None) or ()))


def _device_map(model: nn.Module) -> dict[str, str]:
    """Offload units: each block the model says must not be split (its decoder layers), and
    every other module that owns parameters. A unit's weights load together when it runs (a
    layer reading its children's weights directly still finds them). A persistent buffer that
    no unit holds is named on its own, on the CPU (accelerate wants every state-dict key
    placed)."""
    blocks = set(_blocks(model))
    units: dict[str, str] = {}
    covered: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(c + ".") for c in covered):
            continue
        if type(module).__name__ in blocks and name:
            units[name] = "disk"
            covered.append(name)
        elif any(True for _ in module.parameters(recurse=False)):
            units[name] = "disk"
    for key in model.state_dict(keep_vars=True):  # a buffer outside every unit stays on the CPU
        if not any(key == u or key.startswith(u + ".") or not u for u in units):
            units[key] = "cpu"  # (BART's final_logits_bias: the head class's own buffer)
    return units
