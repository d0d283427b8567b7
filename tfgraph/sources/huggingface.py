"""Hugging Face model directories (``save_pretrained`` output) as a :class:`ModelSource`.

What the graph takes is read off the model, not a registry of architectures:

- the **main input** is the model's ``main_input_name``: token ids (``input_ids``), speech
  features (``input_features``: mel bins × frames), raw audio (``input_values``) or an image
  (``pixel_values``: channels × height × width). Sizes come from the config (vocabulary from
  the input embedding, ``num_mel_bins``, ``num_channels``, ``image_size``); an axis is dynamic
  when the model runs at two different lengths of it (Whisper's frames are fixed, Speech2Text's
  are not), else it keeps the size that ran;
- **sequence-to-sequence** models (``config.is_encoder_decoder``) add ``decoder_input_ids``;
- the **output** is ``logits`` when a forward pass returns them, else ``last_hidden_state``:
  decided from what the model returns, not from its class name (``MarianMTModel`` is an LM);
- **causal LMs** take ``attention_mask`` and derive ``position_ids`` from it as Hugging Face's
  ``generate`` does (``cumsum − 1``, 1 on the pads), so a left-padded batch decodes exactly as
  ``model.generate(input_ids, attention_mask=…)``; their parity inputs left-pad every row after
  the first.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tfgraph.errors import TfgraphError, first_line
from tfgraph.sources import quantized_checkpoint
from tfgraph.sources.checkpoint import (
    Checkpoint,
    MissingTensor,
    loading_whole,
    whole_load_info,
)
from tfgraph.sources.hf_layouts import NAFLEX_INPUTS, candidates, naflex
from tfgraph.sources.hf_wrappers import (
    _ENCODER_ONLY,
    _SEQ2SEQ,
    _HFCausalLM,
    _HFPatches,
    _HFTokens,
    _HFTokensMask,
)
from tfgraph.sources.model import ModelSource, max_positions
from tfgraph.sources.streamed import Streamed, empty_model, prepare_trace

logger = logging.getLogger(__name__)

_LM_SUFFIXES = ("LMHeadModel", "ForCausalLM")
AXIS_PROBES = (2, 5)  # batch, sequence of the probe that decides the output and dynamic axes


# --- the main input -------------------------------------------------------------------------

# make(batch, length, generator) of one input; ``length`` is its dynamic axis' size
_Make = Callable[[int, int, torch.Generator], torch.Tensor]


class _MainInput:
    """How to build the main input: ``make(batch, seq, generator)``, its dynamic axes, and
    how a parity sequence length maps onto its length axis."""

    def __init__(
        self,
        name: str,
        make: _Make,
        axis: int | None,
        base: int,
        symbol: str,
        companions: Callable[[int], dict] | None = None,
    ):
        self.name, self._make, self.axis, self.base, self.symbol = name, make, axis, base, symbol
        self.companions = companions  # batch → the inputs that go with it (NaFlex's grids)

    def length(self, seq: int) -> int:
        return seq if self.name == "input_ids" else self.base + (seq if self.axis else 0)

    def make(self, batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
        return self._make(batch, self.length(seq), generator)

    def axes(self) -> dict[int, str]:
        return {0: "batch", **({self.axis: self.symbol} if self.axis is not None else {})}

    def inputs(self, batch: int, seq: int, generator: torch.Generator) -> dict:
        """The main input and its companions."""
        made = {self.name: self.make(batch, seq, generator)}
        return {**made, **(self.companions(batch) if self.companions else {})}


def vocabulary(model: nn.Module, config, *, decoder: bool = False) -> int:
    """Token ids are drawn below this: the input embedding's rows (what the model really
    takes), else the config's ``vocab_size`` (its text config's for multimodal configs)."""
    try:
        emb = model.get_decoder().get_input_embeddings() if decoder else None
    except (AttributeError, NotImplementedError, TypeError):
        emb = None
    try:
        emb = emb or model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        emb = None
    if isinstance(emb, nn.Embedding):
        return emb.num_embeddings
    for cfg in (config, _text_config(config)):
        vocab = getattr(cfg, "vocab_size", None)
        if isinstance(vocab, int) and vocab > 0:
            return vocab
    raise TfgraphError(
        f"cannot tell the vocabulary of {type(model).__name__}: its config has no vocab_size and "
        "the model no nn.Embedding input; add vocab_size to config.json"
    )


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    try:
        return get() if callable(get) else config
    except Exception:  # a config without a text part
        return config


# --- loading ----------------------------------------------------------------------------------


def from_hf_dir(
    path: Path, *, trust_remote_code: bool, attn_implementation: str | None
) -> ModelSource:
    if not (path / "config.json").is_file():
        raise TfgraphError(
            f"directory '{path}' holds no model: expected config.json and weights from "
            "save_pretrained()"
        )
    weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin")]
    if not weights:
        raise TfgraphError(
            f"directory '{path}' has config.json but no weights (*.safetensors or "
            "pytorch_model.bin)"
        )
    _refuse_remote_code(path, trust_remote_code)  # before transformers reads anything
    try:
        import transformers
    except ImportError as exc:
        raise TfgraphError(
            "loading a Hugging Face directory needs transformers: pip install 'tfgraph[hf]'"
        ) from exc
    transformers.utils.logging.disable_progress_bar()
    try:
        config = transformers.AutoConfig.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as exc:  # a config transformers cannot read is the user's input
        raise TfgraphError(
            f"cannot read '{path / 'config.json'}': {first_line(exc, named=True)}"
        ) from exc
    shipped = quantized_checkpoint.detect(path)  # AWQ / GPTQ: plain Linears, dequantized
    if shipped is not None:
        quantized_checkpoint.without_quantization(config)
        shipped = quantized_checkpoint.QuantizedCheckpoint(path, shipped)
    arch = (config.architectures or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        cls = transformers.AutoModel
    # Mixture-of-experts layers: the library's default ``grouped_mm`` experts do not trace
    # (torch.onnx: "No ONNX function found for transformers.grouped_mm_fallback"); the eager
    # one loops over the experts hit (data-dependent); batched_mm gathers each token's experts
    # and traces. All three compute the same function.
    experts = {"experts_implementation": "batched_mm"} if _has_experts(config) else {}
    source, why = None, "no safetensors (pytorch_model.bin)"
    if Checkpoint.present(path):
        source, why = _streamed_source(cls, config, path, attn_implementation, experts, shipped)
    if source is None:
        if shipped is not None:  # from_pretrained would need autoawq / gptqmodel
            extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
            model = quantized_checkpoint.load_whole(cls, config, {**extra, **experts}, shipped)
        else:
            model = _load_hf_weights(cls, path, trust_remote_code, attn_implementation, experts)
        source = hf_source(model, origin=f"hf:{path}")
        source.info.update(whole_load_info(path, why))
    if shipped is not None:
        source.info["quantized_checkpoint"] = shipped.describe()
    source.info.update(
        {
            "hf_architecture": arch,
            **(
                {
                    "experts_implementation": "batched_mm",
                    "experts_note": "grouped_mm does not trace, nor eager (loops over experts)",
                }
                if experts
                else {}
            ),
        }
    )
    return source


def _streamed_source(
    cls, config, path: Path, attn_implementation, experts, shipped=None
) -> tuple[ModelSource | None, str | None]:
    """A safetensors directory, never loaded whole: traced without weights, the weights bound
    lazily, the eager reference streamed block by block (:mod:`tfgraph.sources.streamed`);
    (None, why) when it cannot stream. ``shipped``: an AWQ / GPTQ checkpoint, whose quantized
    weights are read dequantized (:mod:`tfgraph.sources.quantized_checkpoint`)."""
    checkpoint = shipped or Checkpoint(path)  # a missing or truncated shard is refused here
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    extra.update(experts)
    logger.info("streaming %s from %s (%s)", cls.__name__, path, checkpoint.dtypes())
    streamed = Streamed(cls, config, extra, checkpoint)
    try:
        source = hf_source(
            streamed.model(), origin=f"hf:{path}", trace_model=empty_model(cls, config, extra)
        )
        source.binder = prepare_trace(source.trace_module, checkpoint)
    except (MissingTensor, _StreamFailed) as exc:
        return None, loading_whole(path, exc)
    source.binder.streamed = streamed
    stored = checkpoint.dtypes()
    source.info["checkpoint_dtype"] = max(stored, key=stored.get) if stored else None
    source.info["checkpoint_bytes"] = checkpoint.nbytes
    source.info["eager_reference"] = "streamed (accelerate disk offload from the checkpoint), fp32"
    return source, None


class _StreamFailed(TfgraphError):
    """The streamed model does not run (a module reads weights outside its own forward)."""


def _without_pad(ids: torch.Tensor, config, vocab: int) -> torch.Tensor:
    """Random token ids with the pad id moved to the next id: a token the mask calls real is
    never the pad token. Models that count positions from the ids (M2M100, RoBERTa) skip a pad
    token in a full pass but not in a cached step, so a pad id amid real tokens would make
    their cached and uncached forwards disagree by design, not by error."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    pad = getattr(text, "pad_token_id", None)
    if not isinstance(pad, int) or not 0 <= pad < vocab or vocab < 2:
        return ids
    return torch.where(ids == pad, (pad + 1) % vocab, ids)


def hf_source(
    model: nn.Module, *, origin: str, trace_model: nn.Module | None = None
) -> ModelSource:
    """A loaded Hugging Face ``PreTrainedModel`` as a source (see the module docstring);
    ``trace_model``: the same model built without weights, for torch.export."""
    model = model.eval()
    config = model.config
    main = _main_input(model)
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    params = inspect.signature(model.forward).parameters
    if seq2seq and main not in _SEQ2SEQ:
        raise TfgraphError(
            f"{type(model).__name__}: an encoder-decoder whose encoder takes '{main}' is not "
            "supported (input_ids, input_features, input_values are)"
        )
    tokens = main == "input_ids" or seq2seq
    token_vocab = vocabulary(model, config, decoder=seq2seq) if tokens else 0
    if main == "input_ids":
        encoder_vocab = vocabulary(model, config) if seq2seq else token_vocab

        def make_ids(batch, length, generator):
            ids = torch.randint(0, encoder_vocab, (batch, length), generator=generator)
            return _without_pad(ids, config, encoder_vocab)

        main_input = _MainInput(main, make_ids, 1, 0, "sequence")
    else:
        main_input = _probe_layout(model, config, main, seq2seq, token_vocab)
    output, causal_lm = _output_kind(model, main_input, seq2seq, token_vocab, params)
    if seq2seq:
        wrapper_cls = _SEQ2SEQ[main]
    elif main_input.companions is not None:
        wrapper_cls = _HFPatches
    elif causal_lm and "attention_mask" in params:
        wrapper_cls = _HFCausalLM
    elif main == "input_ids":
        wrapper_cls = _HFTokensMask if "attention_mask" in params else _HFTokens
    else:
        wrapper_cls = _ENCODER_ONLY[main]
    names = wrapper_cls.input_names
    axes = {main: main_input.axes()}
    axes.update({n: {0: "batch"} for n in names if n in NAFLEX_INPUTS})
    if "attention_mask" in names:
        axes["attention_mask"] = {0: "batch", 1: "sequence"}
    if seq2seq:
        axes["decoder_input_ids"] = {0: "batch", 1: "decoder_sequence"}

    def make(batch, seq, generator):
        out = main_input.inputs(batch, seq, generator)
        if "attention_mask" in names:
            mask = torch.ones(batch, seq, dtype=torch.int64)
            if causal_lm:  # rows after the first are left-padded: the padding path is proven
                mask[1:, : seq // 3] = 0
            out["attention_mask"] = mask
        if seq2seq:
            length = max(1, seq - 2)
            ids = torch.randint(0, token_vocab, (batch, length), generator=generator)
            out["decoder_input_ids"] = _without_pad(ids, config, token_vocab)
        return out

    wrapper = wrapper_cls(model, output).eval()
    traced = wrapper_cls(trace_model, output).eval() if trace_model is not None else None
    source = ModelSource(wrapper, names, (output,), axes, make, origin, trace_module=traced)
    source.info.update(
        {
            "model_type": config.model_type,
            "main_input": main,
            "attn_implementation": getattr(config, "_attn_implementation", None),
            **({"causal_lm": True} if causal_lm else {}),
        }
    )
    limit = max_positions(config)
    if limit is not None:
        source.info["max_positions"] = limit
    return source


def _main_input(model) -> str:
    """The model's ``main_input_name``; a generic ``inputs`` is named as the model's forward
    also takes it: as its encoder names it (SpeechEncoderDecoder: raw audio or features,
    whichever its encoder takes), else ``input_ids`` (Perceiver's masked LM)."""
    main = getattr(model, "main_input_name", "input_ids") or "input_ids"
    if main != "inputs":
        return main
    params = inspect.signature(model.forward).parameters
    named = getattr(getattr(model, "encoder", None), "main_input_name", None)
    for name in (named, "input_ids"):
        if name and name != "inputs" and name in params:
            return name
    return main


def _probe_layout(model, config, main: str, seq2seq: bool, vocab: int) -> _MainInput:
    """The first candidate layout the model runs on; dynamic along its length axis when it
    also runs at a longer length."""
    errors = []
    generator = torch.Generator().manual_seed(0)
    patches = naflex(model, config) if main == "pixel_values" else None
    if patches is not None:
        return _MainInput(main, patches[0], None, 0, "patches", companions=patches[1])
    for make, axis, base in candidates(model, config, main):
        try:
            _forward(model, {main: make(2, base, generator)}, seq2seq, vocab)
        except Exception as exc:  # this layout does not fit the model; try the next
            errors.append(first_line(exc, named=True))
            continue
        symbol = "frames" if main == "input_features" else "samples"
        if axis is not None:
            try:
                _forward(model, {main: make(2, base + 8, generator)}, seq2seq, vocab)
            except Exception as exc:  # a fixed length (Whisper's 2 × max_source_positions)
                logger.info("%s: %s has a fixed length %d (%s)", main, symbol, base, exc)
                axis = None
        return _MainInput(main, make, axis, base, symbol)
    error = _StreamFailed if getattr(model, "tfgraph_streamed", False) else TfgraphError
    raise error(
        f"{type(model).__name__} runs on no {main} layout its config suggests "
        f"({'; '.join(errors[:2])}); wrap it in a module with the tfgraph input protocol"
    )


def _forward(model, inputs: dict, seq2seq: bool, vocab: int):
    """One forward pass without a cache, as the wrapper runs the model."""
    if seq2seq:
        batch = next(iter(inputs.values())).shape[0]
        inputs = {**inputs, "decoder_input_ids": torch.randint(0, vocab, (batch, 3))}
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs = {**inputs, "use_cache": False}
    with torch.no_grad():
        return model(**inputs, return_dict=True)


def _output_kind(model, main_input: _MainInput, seq2seq, vocab, params) -> tuple[str, bool]:
    """(``logits`` or ``last_hidden_state``, whether the model is a causal LM), from a forward
    pass: a model returning logits over a token input without an encoder is a causal LM when
    its class says so (…ForCausalLM, …LMHeadModel) or the auto mapping lists it."""
    batch, seq = AXIS_PROBES
    generator = torch.Generator().manual_seed(0)
    try:
        out = _forward(model, main_input.inputs(batch, seq, generator), seq2seq, vocab)
    except Exception as exc:
        error = _StreamFailed if getattr(model, "tfgraph_streamed", False) else TfgraphError
        raise error(
            f"{type(model).__name__} fails on inputs derived from its config "
            f"({first_line(exc, named=True)})"
        ) from exc
    logits = getattr(out, "logits", None) is not None
    if not logits and getattr(out, "last_hidden_state", None) is None:
        raise TfgraphError(
            f"{type(model).__name__} returns neither logits nor last_hidden_state "
            f"({type(out).__name__}); wrap it in a module that returns tensors"
        )
    causal = (
        logits
        and not seq2seq
        and main_input.name == "input_ids"
        and (type(model).__name__.endswith(_LM_SUFFIXES) or _in_causal_mapping(model))
    )
    return ("logits" if logits else "last_hidden_state"), bool(causal)


def _in_causal_mapping(model) -> bool:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _refuse_remote_code(path: Path, trust_remote_code: bool) -> None:
    """Read config.json as plain JSON: a directory that ships its own code (``auto_map``) is
    refused unless the user trusts it, before any library could import that code."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TfgraphError(f"cannot read '{path / 'config.json'}': {exc}") from exc
    if not isinstance(config, dict):
        raise TfgraphError(f"'{path / 'config.json'}' is not a model config (not a JSON object)")
    if config.get("auto_map") and not trust_remote_code:
        raise TfgraphError(
            f"'{path}' needs its own Python code (auto_map in config.json); read it, then pass "
            "--trust-remote-code to run it"
        )


def _has_experts(config) -> bool:
    """A mixture-of-experts config whose experts implementation can be chosen; the experts
    may be in its text config (Nemotron 3.5 Transcribe's language model)."""
    configs = [config, _text_config(config)]
    return hasattr(config, "_experts_implementation") and any(
        getattr(cfg, a, None)
        for cfg in configs
        for a in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    )


def _load_hf_weights(
    cls, path: Path, trust_remote_code: bool, attn_implementation: str | None, experts: dict
):
    """``cls.from_pretrained`` from local files only. safetensors are preferred; a
    ``pytorch_model.bin`` loads through transformers' ``torch.load(weights_only=True)``, so a
    pickle that would run code is refused, not executed."""
    logger.info("loading %s from %s", cls.__name__, path)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    extra.update(experts)
    safetensors = any(path.glob("*.safetensors"))
    if not safetensors:
        logger.info("no safetensors in %s: loading pytorch_model.bin with weights_only", path)
    if "weights_only" in inspect.signature(cls.from_pretrained).parameters:
        extra["weights_only"] = True  # the default of transformers 5; said, not assumed
    try:
        model = cls.from_pretrained(
            path,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            use_safetensors=safetensors,  # never the pickle when safetensors are there
            # fp32 whatever the checkpoint is stored in, as the streamed model: transformers 5
            # loads in the checkpoint's dtype ("auto"), and a bf16 trace is not the fp32 graph
            # the passes and the precision options expect (ONNX Runtime has no bf16 Where)
            dtype=torch.float32,
            **extra,
        )
    except Exception as exc:  # unreadable or unsafe weights are the user's input
        raise TfgraphError(
            f"cannot load the model in '{path}': {first_line(exc, named=True)}; it must be "
            "save_pretrained() output (safetensors, or a plain-tensor pytorch_model.bin)"
        ) from exc
    return model.eval()
