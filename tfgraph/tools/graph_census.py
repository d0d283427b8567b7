"""Graph census: every zoo preset (and, with ``--hf``, the test suite's tiny Hugging Face
models) exported through :func:`tfgraph.export`, each artifact summed up in one JSON entry.

    python -m tfgraph.tools.graph_census OUT.json [--only NAME ...] [--kv-cache-only] [--hf]

Per model: the op histogram (``domain::op_type`` → count, nodes of subgraphs included) and
the initializers (count, bytes, a digest of their contents that ignores names and order) of
every ONNX file written; parity (passed, max abs error per output, prefill/decode); the counts
of the report's fusions section; the wall time. A decoder or encoder-decoder is exported with
``kv_cache=True`` (not Speech2Text, whose positions count the tokens), any other model
without. An export that fails is recorded as an error in its entry; OUT.json is rewritten
after each model, so a crash keeps what was done.

It reads only the public ``tfgraph.export`` and the preset registry (``tfgraph.models``), so
the same file censuses an older commit's code: compare two runs to show that a change left
the graphs alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

logger = logging.getLogger(__name__)

CACHED_FAMILIES = ("decoder", "encoder-decoder")
HF_PREFIX = "hf-"

# The tiny Hugging Face models the test suite builds (tests/e2e/test_hf_pipelines.py,
# tests/hf_input_models.py, tests/sources/test_hf_moe.py): name → (model class, config class, config
# kwargs, kv_cache, attn_implementation). Random init with seed 0, saved with save_pretrained.
_SMALL = {"vocab_size": 500}
_ENC_DEC = {
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
}
_ENCODER = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
_LLAMA = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
}
HF_MODELS = {
    "gpt2": (
        "GPT2LMHeadModel",
        "GPT2Config",
        {**_SMALL, "n_layer": 2, "n_embd": 64, "n_head": 4},
        True,
    ),
    "bert": ("BertModel", "BertConfig", {**_SMALL, **_ENCODER, "intermediate_size": 128}, False),
    "llama": ("LlamaForCausalLM", "LlamaConfig", {**_SMALL, **_LLAMA}, True),
    "t5": (
        "T5ForConditionalGeneration",
        "T5Config",
        {**_SMALL, "num_layers": 2, "d_model": 64, "num_heads": 4, "d_kv": 16, "d_ff": 128},
        True,
    ),
    "bart": ("BartForConditionalGeneration", "BartConfig", {**_SMALL, **_ENC_DEC}, True),
    "bloom": (
        "BloomForCausalLM",
        "BloomConfig",
        {**_SMALL, "n_layer": 2, "hidden_size": 64, "n_head": 4},
        True,
    ),
    "mistral": (
        "MistralForCausalLM",
        "MistralConfig",
        {**_SMALL, **_LLAMA, "sliding_window": 4},
        True,
    ),
    "qwen2": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        {**_SMALL, **_LLAMA, "tie_word_embeddings": True},
        True,
    ),
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        {**_SMALL, **_LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2},
        True,
    ),
    "marian": (
        "MarianMTModel",
        "MarianConfig",
        {"vocab_size": 300, "decoder_start_token_id": 0, "pad_token_id": 0, **_ENC_DEC},
        True,
    ),
    "bart-base": ("BartModel", "BartConfig", {"vocab_size": 300, **_ENC_DEC}, False),
    "whisper": (
        "WhisperForConditionalGeneration",
        "WhisperConfig",
        {
            "vocab_size": 300,
            "num_mel_bins": 16,
            "max_source_positions": 16,
            "max_target_positions": 64,
            "decoder_start_token_id": 1,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "init_std": 0.2,
            **_ENC_DEC,
        },
        True,
    ),
    "speech2text": (
        "Speech2TextForConditionalGeneration",
        "Speech2TextConfig",
        {
            "vocab_size": 300,
            "input_feat_per_channel": 16,
            "input_channels": 1,
            "conv_channels": 32,
            "max_source_positions": 256,
            "max_target_positions": 64,
            **_ENC_DEC,
        },
        False,  # positions counted from the tokens (cumsum): no KV cache
    ),
    "vit": (
        "ViTForImageClassification",
        "ViTConfig",
        {**_ENCODER, "intermediate_size": 128, "image_size": 32, "patch_size": 8, "num_labels": 5},
        False,
    ),
    "wav2vec2": (
        "Wav2Vec2Model",
        "Wav2Vec2Config",
        {
            **_ENCODER,
            "intermediate_size": 128,
            "conv_dim": (32, 32),
            "conv_stride": (5, 4),
            "conv_kernel": (10, 4),
            "num_conv_pos_embeddings": 16,
            "num_conv_pos_embedding_groups": 4,
        },
        False,
    ),
}
# the library's default attention (sdpa) besides eager, where tests/e2e/test_hf_pipelines.py runs it
HF_SDPA = ("gpt2", "llama", "mistral", "bert", "bart")


def hf_models() -> dict[str, tuple]:
    """``hf-NAME`` (eager attention) and ``hf-NAME-sdpa`` → (class, config, kwargs, kv, attn)."""
    models = {f"{HF_PREFIX}{n}": (*spec, "eager") for n, spec in HF_MODELS.items()}
    models.update({f"{HF_PREFIX}{n}-sdpa": (*HF_MODELS[n], "sdpa") for n in HF_SDPA})
    return models


def presets() -> dict[str, bool]:
    """Zoo preset name → whether it is exported with a KV cache (decoders, encoder-decoders)."""
    import tfgraph.models as zoo

    found = {}
    for name in zoo.PRESETS:
        cfg = zoo.PRESETS[name]
        family = getattr(cfg, "family", None) or zoo.describe(name)["family"]
        found[name] = family in CACHED_FAMILIES
    return found


def census_entry(name: str, work: Path) -> dict:
    """Export one preset or ``hf-`` model under ``work`` and sum its artifact up."""
    import tfgraph

    hf = hf_models()
    fields = {}
    if name in hf:
        cls, cfg, kwargs, kv_cache, attn = hf[name]
        model = str(_save_hf(cls, cfg, kwargs, work / "hf"))
        fields["attn_implementation"] = attn
    else:
        kv_cache = presets()[name]
        model = name
    start = time.perf_counter()
    result = tfgraph.export(model, work / "artifact", kv_cache=kv_cache, **fields)
    entry = {"kv_cache": kv_cache, **fields, "export_s": round(time.perf_counter() - start, 2)}
    entry.update(summarize(result.out_dir, result.report))
    if name in hf:
        entry["checkpoint_sha256"] = _digest_files(sorted((work / "hf").glob("*.safetensors")))
    return entry


def _save_hf(cls: str, cfg: str, kwargs: dict, path: Path) -> Path:
    import torch
    import transformers

    config = getattr(transformers, cfg)(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        getattr(transformers, cls)(config).eval().save_pretrained(path)
    return path


def summarize(out_dir: Path, report: dict) -> dict:
    """What the census compares of one artifact: its ONNX files, parity and fusions."""
    parity = report.get("parity", {})
    summary = {
        "files": {p.name: onnx_file_summary(p) for p in sorted(Path(out_dir).glob("*.onnx"))},
        "data_files": sorted(p.name for p in Path(out_dir).iterdir() if p.suffix == ".data"),
        "parity_passed": parity.get("passed"),
        "max_abs_err": {o["name"]: o.get("max_abs_err") for o in parity.get("outputs", [])},
        "fusions": {
            kind: {
                "fused": f.get("fused"),
                "total": f.get("total"),
                "missed": len(f.get("missed", [])),
            }
            for kind, f in report.get("fusions", {}).items()
        },
    }
    # how the eager reference was run, where the report says (a streamed HF checkpoint)
    summary["eager_reference"] = report.get("source", {}).get("eager_reference")
    for phase in ("prefill", "decode"):
        if isinstance(parity.get(phase), dict):
            summary[f"{phase}_max_abs_err"] = parity[phase].get("max_abs_err")
            summary[f"{phase}_passed"] = parity[phase].get("passed")
    return summary


def onnx_file_summary(path: Path) -> dict:
    """Op histogram, node count and initializers (count, bytes, content digest) of one file."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    ops: Counter = Counter()

    def walk(graph) -> None:
        for node in graph.node:
            ops[f"{node.domain or 'ai.onnx'}::{node.op_type}"] += 1
            for attr in node.attribute:
                for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                    walk(sub)

    walk(model.graph)
    for function in model.functions:
        for node in function.node:
            ops[f"function:{node.domain or 'ai.onnx'}::{node.op_type}"] += 1
    digests, nbytes = [], 0
    for tensor in model.graph.initializer:
        array = numpy_helper.to_array(tensor, base_dir=str(path.parent))
        nbytes += array.nbytes
        digest = hashlib.sha256(f"{array.dtype}{array.shape}".encode())
        digest.update(array.tobytes())
        digests.append(digest.hexdigest())
    return {
        "ops": dict(sorted(ops.items())),
        "nodes": sum(ops.values()),
        "initializers": len(model.graph.initializer),
        "initializer_bytes": nbytes,
        "initializers_sha256": hashlib.sha256("".join(sorted(digests)).encode()).hexdigest(),
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
    }


def _digest_files(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def select(only: list[str] | None, *, kv_cache_only: bool = False, hf: bool = False) -> list[str]:
    """The model names to census: ``only`` (presets or ``hf-`` names, checked), else every
    preset (and every ``hf-`` model with ``hf``); ``kv_cache_only`` keeps the cached ones."""
    known = {**presets(), **{n: spec[3] for n, spec in hf_models().items()}}
    if only:
        unknown = [n for n in only if n not in known]
        if unknown:
            raise KeyError(
                f"unknown preset {', '.join(map(repr, unknown))}; known: {', '.join(known)}"
            )
        names = list(only)
    else:
        names = [n for n in known if hf or not n.startswith(HF_PREFIX)]
    return [n for n in names if known[n] or not kv_cache_only]


def census(names: list[str], out: Path, *, on_entry=None) -> dict:
    """Census ``names`` into ``out`` (JSON keyed by name, merged into what ``out`` holds,
    rewritten after each model); ``on_entry(name, entry)`` is called after each."""
    out = Path(out)
    results = json.loads(out.read_text()) if out.exists() else {}
    for name in names:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"census-{name}-") as work:
            try:
                entry = census_entry(name, Path(work))
            except Exception as exc:  # recorded, and the census goes on
                logger.exception("census of %s failed", name)
                entry = {"error": f"{type(exc).__name__}: {exc}"}
        entry["wall_s"] = round(time.perf_counter() - start, 2)
        results[name] = entry
        _write(out, results)
        if on_entry is not None:
            on_entry(name, entry)
    return results


def _write(out: Path, results: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    os.replace(partial, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tfgraph.tools.graph_census", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out", type=Path, help="the JSON file to write (merged if it exists)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these presets or hf- models")
    parser.add_argument("--kv-cache-only", action="store_true", help="only the cached models")
    parser.add_argument("--hf", action="store_true", help="the tiny Hugging Face models too")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        names = select(args.only, kv_cache_only=args.kv_cache_only, hf=args.hf)
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2

    def progress(name: str, entry: dict) -> None:
        if "error" in entry:
            state = f"ERROR {entry['error'][:200]}"
        else:
            errs = [e for e in entry["max_abs_err"].values() if e is not None]
            state = f"parity {'passed' if entry['parity_passed'] else 'FAILED'}" + (
                f" max abs err {max(errs):.3g}" if errs else ""
            )
        print(f"{name}: {state} ({entry['wall_s']:.1f} s)", flush=True)

    census(names, args.out, on_entry=progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
