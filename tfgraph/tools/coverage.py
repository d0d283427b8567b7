"""The coverage matrix: every architecture of the installed transformers that can be made tiny
from its config, exported the way a user would, and measured.

For each model type in transformers' auto mappings (causal LMs, sequence-to-sequence LMs,
speech encoder-decoders, text encoders, vision and speech encoders):

1. a tiny config (:func:`tiny_config`: 2 layers, width 64, 4 heads, vocabulary 512 …, set only
   where the default config has the attribute, then rebuilt so derived fields follow; a
   composite config's sub-configs — a multimodal model's ``text_config`` and
   ``vision_config``, T5Gemma's ``encoder``/``decoder`` — made tiny the same way, each
   rebuilt from its own class), random weights, ``save_pretrained`` into a temporary
   directory;
2. ``export`` with the default pipeline: status, attention and norm fused/total with every miss
   reason, parity;
3. decoders (causal and seq2seq LMs): ``export --kv-cache``, then 32 greedy tokens for two
   left-padded prompts with :func:`tfgraph.runtime.generate` against Hugging Face
   ``model.generate`` (no processors: a plain greedy config); speech encoder-decoders against
   eager greedy decoding, since Whisper's ``generate`` post-processes its output.

Each architecture runs in its own process (bounded memory, a timeout, a crash is a row); the
JSON is written after every row, so a run resumes where it stopped. ``python -m tfgraph
coverage --out docs`` writes ``docs/coverage.json`` and ``docs/COVERAGE.md``. The token
check is in :mod:`tfgraph.tools.coverage_generation`, the report (complete rows, summary,
``COVERAGE.md``) in :mod:`tfgraph.tools.coverage_report`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tfgraph.tools.coverage_generation import greedy_vs_hf
from tfgraph.tools.coverage_report import DECODER_KINDS, environment, markdown, summarize

logger = logging.getLogger(__name__)

KINDS = ("causal-lm", "seq2seq-lm", "speech-seq2seq", "encoder", "vision", "speech-encoder")
# the order a model type is claimed in: encoder-decoders before their decoder-only heads
# (WhisperForCausalLM, BartForCausalLM), text encoders before their causal-LM heads
_CLAIM_ORDER = ("speech-seq2seq", "seq2seq-lm", "encoder", "causal-lm", "vision", "speech-encoder")
_MAPPINGS = {  # kind: transformers auto mapping (model_type → class name)
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "encoder": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "vision": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "speech-encoder": "MODEL_FOR_CTC_MAPPING_NAMES",
}
NO_ATTENTION = "no attention"  # exported, but not a transformer (a ConvNet, a state-space LM)
TIMEOUT_S = 420  # one architecture, both exports and generation

# Attributes set where the default config has them (tiny and consistent: 4 heads × 16 = 64).
TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "embed_dim": 64,
    "dim": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "n_layers": 2,
    "num_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "d_kv": 16,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "d_ff": 128,
    "n_inner": 128,
    "hidden_dim": 128,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "image_size": 32,
    "patch_size": 8,
    "num_mel_bins": 16,
    "max_source_positions": 64,
    "max_target_positions": 128,
    # widths derived from the head size elsewhere (DeepSeek's MLA, CodeGen's rotary part)
    "qk_rope_head_dim": 16,  # = head_dim: MLA's rotary part
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "rotary_dim": 8,
    "n_shared_experts": 1,
    "n_group": 1,  # DeepSeek's grouped routing over the (now 4) experts
    "topk_group": 1,
    "attention_types": [[["global", "local"], 1]],  # GPT-Neo: one global + one local layer
    # tables sized apart from the vocabulary and width (measured on the meta device: BLT's
    # hash embeddings 3.0 M x 64, Gemma 4's per-layer embeddings 262 k x 512)
    "encoder_hash_byte_group_vocab": 512,
    "hidden_size_global": 64,
    "vocab_size_per_layer_input": 512,
    "hidden_size_per_layer_input": 16,
    # linear-attention and state-space layers (Gated DeltaNet, Mamba, Mamba-2)
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "state_size": 16,
    "ssm_state_size": 16,
    "mamba_d_state": 16,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "time_step_rank": 8,
    "mamba_dt_rank": 8,
    "mamba_d_ssm": 128,  # = 2 × 64: Falcon-H1's Mamba width
    "n_groups": 1,
    # hybrids whose pattern is derived from indices (one attention layer after one recurrent)
    "attn_layer_period": 2,  # Jamba: attention where i % period == offset
    "attn_layer_offset": 1,
    "attn_layer_indices": [1],  # Bamba (default: none, Mamba-2 layers only)
    # Qwen4-Exp's QSA indexer: every indexed-attention layer builds one, and the default
    # config leaves its sizes None (the model then fails: None // None)
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 16,
    "indexer_compress_ratio": 4,
}
# Per model type: hybrids whose default config does not show every kind of layer its model
# has, given each kind once (as :func:`_tiny_layer_types` does for a default pattern).
TINY_BY_MODEL = {
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},  # Mamba only
    # no default pattern (the model indexes None); one dense layer, then a MoE one
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # two hybrid layers: with one, the shared transformer Zamba ties to the first hybrid layer
    # has nothing to tie and from_config raises ("issue with your definition of
    # `tie_weights_keys`")
    "zamba": {"layer_types": ["linear_attention", "hybrid", "hybrid"]},
    # vision: per-stage lists cut with the stage count (num_stages is an alias of
    # num_hidden_layers: 2 stages of a 4-stage list ended in a 768-wide norm on 192 channels)
    "convnext": {"hidden_sizes": [16, 32], "depths": [1, 1]},
    "convnextv2": {"hidden_sizes": [16, 32], "depths": [1, 1]},
    # the top conv is round_filters(1280) x width_coefficient wide, and hidden_dim must equal
    # it: 0.1 makes it 128 (= TINY hidden_dim)
    "efficientnet": {"width_coefficient": 0.1, "depth_coefficient": 0.5},
    # the stem downsamples by 16 whatever patch_size says; 64 pixels leave 4 x 4 tokens
    "levit": {"patch_size": 16, "image_size": 64, "depths": [1, 1, 1]},
    # patch_size is the unfold window over a map already downsampled by 8-32
    "mobilevitv2": {"patch_size": 2, "image_size": 64, "width_multiplier": 0.25},
    # the adaptor's width must be the text model's hidden size / 4 (TINY hidden_size 64)
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": 16}},
}
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
EAGER_FAILED = "eager failed"  # the tiny model does not run on inputs from its own config


def architectures(only: Iterable[str] | None = None) -> list[tuple[str, str, str]]:
    """(model_type, kind, class name) for every architecture of the installed transformers;
    a model type counts once, in the first kind of :data:`_CLAIM_ORDER` that lists it (text
    encoders that also have a causal-LM head count as encoders, Whisper as a speech
    encoder-decoder)."""
    from transformers.models.auto import modeling_auto

    seen: dict[str, tuple[str, str, str]] = {}
    for kind in _CLAIM_ORDER:
        for model_type, cls in getattr(modeling_auto, _MAPPINGS[kind]).items():
            if model_type in seen:
                continue
            if isinstance(cls, (tuple, list)):
                cls = cls[0]
            seen[model_type] = (model_type, kind, cls)
    rows = sorted(seen.values(), key=lambda r: (KINDS.index(r[1]), r[0]))
    if only:
        wanted = set(only)
        rows = [r for r in rows if r[0] in wanted]
    return rows


def tiny_config(model_type: str, kind: str = ""):
    import transformers

    default = transformers.AutoConfig.for_model(model_type)
    overrides = {k: v for k, v in TINY.items() if _has(default, k)}
    # sub-configs made tiny too: the top-level overrides never reach them, and a multimodal
    # model built from its default vision/audio/text configs has 2.7-12.7 billion parameters
    # (measured: gemma3 2.7 B, qwen2_audio 12.7 B), which killed the worker for memory
    overrides.update(_tiny_sub_configs(default))
    by_model = dict(TINY_BY_MODEL.get(model_type, {}))
    overrides.update(_tiny_layer_types(default, by_model.pop("layer_types", None)))
    for key, value in by_model.items():  # a sub-config's entries merge into its tiny dict
        if isinstance(value, dict) and isinstance(overrides.get(key), dict):
            value = {**overrides[key], **value}
        overrides[key] = value
    if _has(default, "expand") and {"head_dim", "num_heads", "hidden_size"} <= set(overrides):
        # Mamba-2: heads × head size is the expanded width
        overrides["head_dim"] = overrides["hidden_size"] * default.expand // overrides["num_heads"]
    if "kv_lora_rank" in overrides and "num_key_value_heads" in overrides:
        overrides["num_key_value_heads"] = overrides["num_attention_heads"]  # MLA: K/V per head
    if default.is_encoder_decoder:
        overrides.setdefault("decoder_start_token_id", 1)
    if kind == "causal-lm":  # BERT-style decoders (bert-generation) are causal only so
        overrides["is_decoder"] = True
    overrides.update(SPECIAL_TOKENS)
    for _ in range(len(overrides)):  # drop an override the config refuses, and retry
        try:
            return transformers.AutoConfig.for_model(model_type, **overrides)
        except Exception as exc:
            refused = [k for k in overrides if f"'{k}'" in str(exc)]
            if not refused and _pattern_key(default) in overrides:
                # a pattern the config derives itself (RecurrentGemma's read-only
                # layers_block_type): its own, cut to the tiny depth
                refused = [_pattern_key(default)]
            if not refused:
                raise
            overrides.pop(refused[0])
    return transformers.AutoConfig.for_model(model_type, **overrides)


def _tiny_layer_types(config, kinds: list[str] | None = None) -> dict:
    """A hybrid's layer pattern made tiny: each kind of layer once, in the order the default
    pattern first uses it (Qwen3-Next's three linear-attention layers to one full-attention
    layer become one of each), so that the tiny model has every kind; at least 2 layers.
    ``kinds`` (from :data:`TINY_BY_MODEL`) replaces a default pattern that lacks a kind."""
    if kinds is None:
        types = getattr(config, "layer_types", None)
        if not isinstance(types, (list, tuple)) or not types or not isinstance(types[0], str):
            return {}
        kinds = list(dict.fromkeys(types))
        if len(kinds) == 1:
            return {}
    out: dict = {_pattern_key(config): list(kinds)}
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if _has(config, key):
            out[key] = len(kinds)
    return out


def config_for(cls, config):
    """The config ``cls`` is built from: a composite config's text config where ``cls`` takes
    only that (Qwen3.5's ``Qwen3_5ForCausalLM`` under the ``qwen3_5`` model type, which has no
    ``vocab_size`` of its own), as ``AutoModelForCausalLM.from_config`` does."""
    wanted = getattr(cls, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    text = config.get_text_config()
    return text if isinstance(text, wanted) else config


def _pattern_key(config) -> str:
    """The field that holds the layer pattern: Zamba's ``layer_types`` is an alias of
    ``layers_block_type``, set only after the config derived ``hybrid_layer_ids`` from its
    default pattern (Zamba2 then looks up layers that do not exist: KeyError)."""
    return getattr(type(config), "attribute_map", {}).get("layer_types", "layer_types")


def _tiny_sub_configs(config, depth: int = 0) -> dict:
    """``{name: tiny sub-config as a dict}`` for each sub-config of a composite config (its
    nested ones made tiny too), each rebuilt from its own class with the :data:`TINY` values
    it has; a sub-config whose class refuses them keeps its default."""
    from transformers import PretrainedConfig

    out = {}
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if not isinstance(sub, PretrainedConfig) or depth > 2:
            continue
        overrides = {k: v for k, v in TINY.items() if _has(sub, k)}
        heads = ("num_attention_heads", "num_key_value_heads")
        if all(_has(sub, k) for k in heads) and len({getattr(sub, k) for k in heads}) == 1:
            # an MHA sub-config stays MHA: NeMo's ASR encoders save q/k/v fused and split them
            # in three equal parts on load, which a GQA tiny config would not survive
            overrides["num_key_value_heads"] = overrides.get("num_attention_heads")
        # special tokens inside the tiny vocabulary (mllama's text config pads with 128004)
        overrides.update({k: v for k, v in SPECIAL_TOKENS.items() if _has(sub, k)})
        # its role in the composite (SpeechEncoderDecoder's BERT decodes: causal, cross-attending)
        roles = ("is_decoder", "add_cross_attention")
        overrides.update({k: True for k in roles if _has(sub, k) and getattr(sub, k)})
        overrides.update(_tiny_sub_configs(sub, depth + 1))
        overrides.update(_tiny_layer_types(sub))  # Qwen3.5's text config keeps its attention
        built = _build(type(sub), overrides)
        if built is not None:
            out[name] = built.to_dict()
    return out


def _build(cls, overrides: dict):
    """``cls(**overrides)``, dropping an override it refuses and retrying; None if none fits."""
    overrides = dict(overrides)
    for _ in range(len(overrides) + 1):
        try:
            return cls(**overrides)
        except Exception as exc:
            refused = [k for k in overrides if f"'{k}'" in str(exc) or k in str(exc)]
            if not refused:
                return None
            overrides.pop(refused[0])
    return None


def _has(config, name: str) -> bool:
    try:
        return hasattr(config, name)
    except Exception:  # a per-layer attribute that refuses a global read
        return False


# --- one architecture (in its own process) ----------------------------------------------------


def measure(model_type: str, kind: str, cls_name: str, work: Path) -> dict:
    """The row of one architecture; every failure is caught and stated with its message."""
    import torch
    import transformers

    import tfgraph
    from tfgraph.errors import first_line
    from tfgraph.sources.trace import TraceCache

    row: dict = {"model_type": model_type, "kind": kind, "class": cls_name}
    try:
        cls = getattr(transformers, cls_name)
        config = config_for(cls, tiny_config(model_type, kind))
        torch.manual_seed(0)
        model = cls(config).eval()
        _untie_zero_weights(model)
        model.save_pretrained(work / "hf")
    except Exception as exc:  # the architecture cannot be built tiny from its config
        row.update(status="not built", reason=first_line(exc, named=True))
        return row
    row["parameters"] = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    traces = TraceCache(by_origin=True)  # the cached export reuses the plain one's trace
    try:
        result = tfgraph.export(str(work / "hf"), work / "plain", trace_cache=traces)
    except Exception as exc:  # a trace failure is the row's finding
        row.update(status=_failure(exc), reason=first_line(exc, named=True))
        return row
    finally:
        row["export_s"] = round(time.perf_counter() - start, 1)
    _fill(row, result.report)
    if not row["parity"]:  # before any tfgraph pass too? then the translation is the cause
        try:
            raw = tfgraph.export(
                str(work / "hf"), work / "untouched", pipeline="none", trace_cache=traces
            )
            row["parity_without_passes"] = bool(raw.report["parity"]["passed"])
        except Exception as exc:  # noqa: BLE001 - the diagnostic only
            row["parity_without_passes_error"] = first_line(exc, named=True)
    # a recurrent layer (linear attention, a state-space scan) mixes tokens as attention does
    mixes = row["attention"][1] + row["recurrent"][1]
    row["status"] = "exported" if mixes else NO_ATTENTION
    if kind not in DECODER_KINDS or not mixes:
        return row
    try:
        cached = tfgraph.export(
            str(work / "hf"), work / "cached", kv_cache=True, trace_cache=traces
        )
    except Exception as exc:
        row.update(kv_cache=False, kv_reason=first_line(exc, named=True))
        return row
    row["kv_cache"] = True
    row["kv_parity"] = bool(cached.report["parity"]["passed"])
    try:
        row.update(greedy_vs_hf(work, model, kind))
    except Exception as exc:
        row.update(tokens_equal=False, tokens_reason=first_line(exc, named=True))
    return row


def _untie_zero_weights(model) -> None:
    """Matrices initialized to exactly zero drawn at random (std 0.02). AFMoE zero-inits its
    router: every expert then ties, and each runtime's top-k breaks the tie its own way, so
    eager and ONNX Runtime route differently on a model no checkpoint looks like."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2 and param.numel() and not param.any():
                param.normal_(0.0, 0.02)


def _failure(exc: Exception) -> str:
    if "fails on inputs derived from its config" in str(exc):
        return EAGER_FAILED
    text = str(exc).lower()
    if "tracing" in text or "torch.export" in text or "cannot trace" in text:
        return "trace failed"
    return "export failed"


def _fill(row: dict, report: dict) -> None:
    fusions = report["fusions"]
    for family in ("attention", "norm", "recurrent"):
        entry = fusions.get(family, {})
        row[family] = [entry.get("fused", 0), entry.get("total", 0)]
        missed = entry.get("missed", [])
        if missed:
            row[f"{family}_missed"] = sorted(
                {m.get("reason", str(m)) if isinstance(m, dict) else str(m) for m in missed}
            )
    parity = report["parity"]
    row["parity"] = bool(parity["passed"])
    row["max_abs_err"] = max(o["max_abs_err"] for o in parity["outputs"])
    row["main_input"] = report["source"].get("main_input")
    if report["source"].get("attn_fallback"):
        row["attn_fallback"] = report["source"]["attn_fallback"]


def _worker(argv: list[str]) -> int:
    """The row's process. Its working directory belongs to the parent, which removes it even
    when this process is killed (a timeout, the kernel's OOM killer): a killed worker cannot
    leave gigabytes of checkpoints and ONNX files in the temporary directory."""
    model_type, kind, cls_name, out, work = argv
    logging.basicConfig(level=logging.ERROR)
    row = measure(model_type, kind, cls_name, Path(work))
    Path(out).write_text(json.dumps(row))
    return 0


# --- the whole matrix ---------------------------------------------------------------------------


def run_one(model_type: str, kind: str, cls_name: str, timeout: float = TIMEOUT_S) -> dict:
    """One architecture in a fresh process; a timeout or a crash is a row too."""
    with tempfile.TemporaryDirectory(prefix=f"cov-{model_type}-") as tmp:
        out, work = Path(tmp) / "row.json", Path(tmp) / "work"
        work.mkdir()
        args = [model_type, kind, cls_name, str(out), str(work)]
        cmd = [sys.executable, "-m", "tfgraph.tools.coverage", *args]
        # the worker's own temporary files (libraries' scratch) land in the same directory
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "TMPDIR": str(work),
        }
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {
                "model_type": model_type,
                "kind": kind,
                "class": cls_name,
                "status": "timeout",
                "reason": f"over {timeout:.0f} s",
                "seconds": round(time.perf_counter() - start, 1),
            }
        if out.is_file():
            row = json.loads(out.read_text())
        else:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            row = {
                "model_type": model_type,
                "kind": kind,
                "class": cls_name,
                "status": "crashed",
                "reason": f"exit {done.returncode}: {tail[:300]}",
            }
        row["seconds"] = round(time.perf_counter() - start, 1)
        return row


def run(
    out_dir: Path,
    *,
    only: Iterable[str] | None = None,
    jobs: int = 1,
    limit: int | None = None,
    progress: Callable[[dict, int, int], None] | None = None,
    fresh: bool = False,
) -> dict:
    """Measure every architecture (or ``only`` these model types), ``jobs`` at a time; rows
    already in ``out_dir/coverage.json`` are kept unless ``fresh``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "coverage.json"
    data = json.loads(path.read_text()) if path.is_file() and not fresh else {}
    rows = {r["model_type"]: r for r in data.get("rows", [])}
    todo = [a for a in architectures(only) if a[0] not in rows]
    if limit is not None:
        todo = todo[:limit]
    data["meta"] = {**environment(), "known": len(architectures(only))}
    total = len(todo)

    def one(arch):
        return {**run_one(*arch), "measured_at": data["meta"]["commit"]}

    def write() -> None:
        order = sorted(rows.values(), key=lambda r: (KINDS.index(r["kind"]), r["model_type"]))
        data["rows"], data["summary"] = order, summarize(order)
        path.write_text(json.dumps(data, indent=1))
        (out_dir / "COVERAGE.md").write_text(markdown(data))

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for i, row in enumerate(pool.map(one, todo), 1):
            rows[row["model_type"]] = row
            write()
            if progress is not None:
                progress(row, i, total)
    write()
    return data


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
