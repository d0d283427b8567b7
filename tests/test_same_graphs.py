"""The same graph as before the house redesign (issue 45): every zoo preset and every Hugging
Face model the tests build gives the op sequence it gave before the files moved.

Each case exports a model with the public API (``tfgraph.export``) and reads back, per graph
file of the artifact (``manifest.json``'s ``files``: ``model.onnx``, a seq2seq's
``encoder.onnx``), the nodes in saved order as ``domain::op_type`` (a subgraph's nodes inside
``[attribute`` … ``]``), the graph's input and output names, its initializer count and opsets.
A case whose export fails records the exception's type and first line, and that is compared
too (the same errors). ``tests/data/graphs_before.json`` holds what the tree before the moves
gave (written by :func:`write_golden`, run under that tree); a mismatch is a behaviour change,
never a reason to rewrite the file from the new tree. A change made on purpose since (a new
fusion) re-records only the cases it changes, after reading their differences, and names them
in the file's ``about``.

Cases (``model|target[|kv][|eager]``): every preset on ``ort``; decoder and encoder-decoder
presets cached on ``ort`` and ``onnx``, encoder presets' cached refusal; the Hugging Face model
types the tests use, built tiny as the coverage matrix builds them
(:func:`tfgraph.tools.coverage.tiny_config`, seed 0), on ``ort``, decoders cached too; a few
with eager attention. A handful run in the default tier, the rest are ``slow``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "data" / "graphs_before.json"
CHECK_EACH_PASS_ENV = "TFGRAPH_CHECK_EACH_PASS"  # off here and in the generator: one setting

# the default tier: a few presets (a cached decoder on ort and on onnx, a cached seq2seq) and
# Hugging Face models of three kinds (a cached decoder, an encoder, a cached recurrent LM)
DEFAULT_TIER = (
    "preset:gpt-tiny|ort",
    "preset:llama-tiny|ort|kv",
    "preset:llama-tiny|onnx|kv",
    "preset:t5-tiny|ort|kv",
    "tiny:gpt2|ort|kv",
    "tiny:bert|ort",
    "tiny:mamba|ort|kv",
)
# Hugging Face model types the tests build (tests/test_*.py, tests/hf_input_models.py) and
# those with per-model tiny entries (tfgraph.tools.tiny_configs.TINY_BY_MODEL)
HF_TYPES = (
    "bamba", "bart", "bert", "bloom", "convbert", "convnext", "convnextv2", "cpmant",
    "deepseek_v3", "deepseek_v32", "efficientnet", "fun_asr_nano", "gemma3", "gpt2", "gpt_neo",
    "gpt_neox", "gpt_neox_japanese", "gpt_oss", "granitemoehybrid", "hy_v4", "jamba", "jetmoe",
    "led", "levit", "lfm2_moe", "lfm3", "llama", "longformer", "longt5", "mamba", "marian",
    "minimax", "mistral", "mixtral", "mllama", "mobilevitv2", "moonshine", "mpnet", "mpt", "mvp",
    "nemo_speechlm", "neomme", "omniasr_ctc", "opt", "parakeet_ctc", "perceiver", "qwen2",
    "qwen2_audio", "qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen4_exp_text", "recurrent_gemma",
    "rwkv", "siglip2", "speech_to_text", "switch_transformers", "t5", "t5gemma", "t5gemma2",
    "trocr", "vit", "wav2vec2", "wav2vec2-bert", "wavlm", "whisper", "xglm", "xlstm", "zamba",
    "zamba2",
)  # fmt: skip
# eager attention as well as the library default (tests/test_hf_pipelines.py runs both)
EAGER_TYPES = ("gpt2", "llama", "bert", "bart")
DECODER_KINDS = ("causal-lm", "seq2seq-lm", "speech-seq2seq")


def preset_cases() -> list[str]:
    from tfgraph.models.presets import PRESETS

    cases = []
    for name, config in PRESETS.items():
        cases.append(f"preset:{name}|ort")
        if config.family in ("decoder", "encoder-decoder"):
            cases += [f"preset:{name}|ort|kv", f"preset:{name}|onnx|kv"]
        else:  # refused: an encoder's attention is not causal (the error is compared)
            cases.append(f"preset:{name}|ort|kv")
    return cases


def hf_cases() -> list[str]:
    from tfgraph.tools.coverage import architectures

    kinds = {}  # the kind that claims the type (a VLM's whole row comes after it)
    for model_type, kind, _ in architectures(HF_TYPES):
        kinds.setdefault(model_type, kind)
    cases = []
    for model_type in HF_TYPES:
        cases.append(f"tiny:{model_type}|ort")
        if kinds.get(model_type) in DECODER_KINDS:
            cases.append(f"tiny:{model_type}|ort|kv")
        if model_type in EAGER_TYPES:
            cases.append(f"tiny:{model_type}|ort|eager")
            if kinds.get(model_type) in DECODER_KINDS:
                cases.append(f"tiny:{model_type}|ort|kv|eager")
    return cases


def all_cases() -> list[str]:
    return preset_cases() + hf_cases()


# --- one case: export, then the op sequence of each graph file --------------------------------


def graphs_of(case: str, work: Path) -> dict:
    """``{"outcome": "ok", "graphs": {file: graph}}`` for the artifact of ``case`` exported into
    ``work``, or ``{"outcome": "error", "error": "Type: first line"}`` where building or
    exporting the model fails."""
    import numpy as np
    import torch

    import tfgraph

    model, target, *flags = case.split("|")
    options = {"target": target, "kv_cache": "kv" in flags}
    if "eager" in flags:
        options["attn_implementation"] = "eager"
    saved = os.environ.pop(CHECK_EACH_PASS_ENV, None)
    try:
        source = _hf_directory(model.split(":", 1)[1], work) if model.startswith("tiny:") else None
        torch.manual_seed(0)
        np.random.seed(0)
        spec = model.split(":", 1)[1] if source is None else str(source)
        result = tfgraph.export(spec, work / "artifact", **options)
    except Exception as exc:  # the refusal or failure is the expected outcome
        return {"outcome": "error", "error": _error_line(exc, work)}
    finally:
        if saved is not None:
            os.environ[CHECK_EACH_PASS_ENV] = saved
    files = [f for f in result.manifest["files"] if f.endswith(".onnx")]  # not weights' data
    return {"outcome": "ok", "graphs": {f: _graph_summary(work / "artifact" / f) for f in files}}


def _hf_directory(model_type: str, work: Path) -> Path:
    """The tiny model of ``model_type`` saved as a user's checkpoint directory, built as
    :func:`tfgraph.tools.coverage.measure` builds it (seed 0, zero routers drawn)."""
    import torch
    import transformers

    from tfgraph.tools import coverage

    rows = coverage.architectures([model_type])
    if not rows:
        raise LookupError(f"{model_type} is not an architecture of this transformers")
    _, kind, cls_name = rows[0]
    cls = getattr(transformers, cls_name)
    config = coverage.config_for(cls, coverage.tiny_config(model_type, kind))
    torch.manual_seed(0)
    model = cls(config).eval()
    coverage._untie_zero_weights(model)
    model.save_pretrained(work / "hf")
    return work / "hf"


def _error_line(exc: BaseException, work: Path) -> str:
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    text = text.replace(str(work.resolve()), "<work>").replace(str(work), "<work>")
    return re.sub(r"0x[0-9a-f]{6,}", "0x…", text)


def _graph_summary(path: Path) -> dict:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    summary = {
        "inputs": [v.name for v in graph.input],
        "outputs": [v.name for v in graph.output],
        "initializers": len(graph.initializer),
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "ops": _ops(graph),
    }
    if model.functions:
        summary["functions"] = {f"{f.domain}::{f.name}": _ops(f) for f in model.functions}
    return summary


def _ops(graph) -> list[str]:
    """``domain::op_type`` of each node in saved order, a subgraph's nodes in brackets."""
    out = []
    for node in graph.node:
        out.append(f"{node.domain}::{node.op_type}")
        for attr in node.attribute:
            for body in [attr.g] if attr.HasField("g") else list(attr.graphs):
                out += [f"[{attr.name}", *_ops(body), "]"]
    return out


# --- comparison ---------------------------------------------------------------------------------


def differences(want: dict, got: dict) -> list[str]:
    """What differs between two outcomes, readably: the error lines, the graph files, per file
    the names and counts, and the first differing positions of the op sequence."""
    if want["outcome"] != got["outcome"] or want.get("error") != got.get("error"):
        return [f"outcome: before {_outcome(want)}, now {_outcome(got)}"]
    if want["outcome"] != "ok":
        return []
    lines = []
    if list(want["graphs"]) != list(got["graphs"]):
        lines.append(f"graph files: before {list(want['graphs'])}, now {list(got['graphs'])}")
    for name in want["graphs"]:
        if name in got["graphs"]:
            lines += [
                f"{name}: {d}" for d in _graph_diff(want["graphs"][name], got["graphs"][name])
            ]
    return lines


def _outcome(entry: dict) -> str:
    return "ok" if entry["outcome"] == "ok" else repr(entry["error"])


def _graph_diff(want: dict, got: dict) -> list[str]:
    lines = []
    for key in ("inputs", "outputs", "initializers", "opsets"):
        if want.get(key) != got.get(key):
            lines.append(f"{key}: before {want.get(key)}, now {got.get(key)}")
    lines += _sequence_diff("ops", want["ops"], got["ops"])
    want_fns, got_fns = want.get("functions", {}), got.get("functions", {})
    if set(want_fns) != set(got_fns):
        lines.append(f"functions: before {sorted(want_fns)}, now {sorted(got_fns)}")
    for name in sorted(set(want_fns) & set(got_fns)):
        lines += _sequence_diff(f"function {name}", want_fns[name], got_fns[name])
    return lines


def _sequence_diff(label: str, want: list[str], got: list[str], shown: int = 12) -> list[str]:
    """The op counts that changed, and up to ``shown`` positions where the sequences differ
    (after the first, each position of the longer one)."""
    if want == got:
        return []
    from collections import Counter

    before, now = Counter(want), Counter(got)
    counts = {op: (before[op], now[op]) for op in sorted(before | now) if before[op] != now[op]}
    lines = [f"{label}: {len(want)} nodes before, {len(got)} now; counts (before, now): {counts}"]
    first = next(i for i in range(max(len(want), len(got))) if _at(want, i) != _at(got, i))
    for i in range(first, min(first + shown, max(len(want), len(got)))):
        lines.append(f"  {label}[{i}]: before {_at(want, i)}, now {_at(got, i)}")
    return lines


def _at(sequence: list[str], i: int) -> str:
    return sequence[i] if i < len(sequence) else "(end)"


# --- the golden file ----------------------------------------------------------------------------


def load_golden() -> dict:
    return json.loads(GOLDEN.read_text())["cases"]


def write_golden(results: dict, path: Path = GOLDEN, note: str = "") -> None:
    """One line per case, so that a diff of the file reads case by case."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"  {json.dumps(c)}: {json.dumps(results[c])}" for c in results]
    head = json.dumps(note or "op sequences before the moves of issue 45")
    path.write_text('{"about": ' + head + ',\n "cases": {\n' + ",\n".join(lines) + "\n}}\n")


def _params() -> list:
    cases = all_cases()
    return [c if c in DEFAULT_TIER else pytest.param(c, marks=pytest.mark.slow) for c in cases]


@pytest.fixture(scope="module")
def golden():
    return load_golden()


@pytest.mark.parametrize("case", _params())
def test_same_graph_as_before(case, golden, tmp_path):
    pytest.importorskip("transformers")
    assert case in golden, f"{case} has no recorded graph in {GOLDEN.name}"
    got = graphs_of(case, tmp_path)
    diff = differences(golden[case], got)
    assert not diff, f"{case} differs from before the moves:\n" + "\n".join(diff)


def test_every_recorded_case_is_a_case():
    """A case dropped from the lists would silently go unchecked."""
    assert set(load_golden()) == set(all_cases())
