"""A Triton Inference Server model repository from a tfgraph artifact (``tfgraph triton``).

Driven by the manifest (every tensor's ``role``), the repository holds:

- **the engine** (``NAME``, and ``NAME_encoder`` for an encoder-decoder) for Triton's
  ``onnxruntime`` backend: ``config.pbtxt`` with every input and output, ``-1`` for dynamic
  axes. A graph whose inputs and outputs all lead with the same dynamic batch axis gets
  ``max_batch_size`` and ``dynamic_batching``; a KV-cached decoder gets a ``sequence_batching``
  block whose implicit ``state`` maps each past input to its present output (zero initial
  state), so Triton keeps the cache between the requests of a sequence. These configs are
  checked offline against Triton's ``ModelConfig`` and the ONNX graph (this machine has no
  onnxruntime backend to run them).
- **the generation model** (``NAME_generate``, KV-cached artifacts only) on Triton's Python
  backend, decoupled: :mod:`tfgraph.runtime.serving.triton_generate` runs tfgraph's generation loop
  over a copy of the artifact and streams each token back as it is chosen. Run for real here.
  A vision-language artifact (``export`` of a VLM directory) gets the generation model only,
  with an optional ``image`` input (the image file's bytes): its processor, vision graph and
  decoder run inside it, so there is no engine model to write.

``tfgraph-repository.json`` at the top says what was written from which artifact; a directory
holding it is the only non-empty one ``tfgraph triton`` replaces.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from tfgraph import contract
from tfgraph.errors import TfgraphError
from tfgraph.exporters import staged_directory
from tfgraph.runtime.serving.launcher import python_site_paths
from tfgraph.runtime.serving.repository_checks import check_config, parse_config  # noqa: F401

logger = logging.getLogger(__name__)

MARKER = "tfgraph-repository.json"
GENERATE_SUFFIX = "_generate"
ENCODER_SUFFIX = "_encoder"
PLAN_SUFFIX = "_trt"
ENGINE_SUFFIXES = (".plan", ".engine")
DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_CONCURRENCY = 16  # generation requests one batch of the generation model holds
DEFAULT_SLOT_CAPACITY = 1024  # positions per cache slot (in-flight batching), at most the model's
BATCH_WAIT_MS = 2  # how long the first request of a batch waits for others
# in-flight batching's chunked prefill (prompt tokens per step; 0: whole prompts) and prefix
# cache (MiB; 0: off): tfgraph serve's defaults, for the same reasons (docs/serving.md)
DEFAULT_PREFILL_CHUNK, DEFAULT_PREFIX_CACHE_MB = 64, 256
DRAFT_DIR = "speculative-draft"  # a draft artifact's copy in the artifact's (make_batcher)

TRITON_TYPES = {
    "float": "TYPE_FP32",
    "float16": "TYPE_FP16",
    "bfloat16": "TYPE_BF16",
    "double": "TYPE_FP64",
    "int64": "TYPE_INT64",
    "int32": "TYPE_INT32",
    "int8": "TYPE_INT8",
    "uint8": "TYPE_UINT8",
    "bool": "TYPE_BOOL",
}
# past input → present output held as Triton state: KV and the recurrent layers' states
_PAST = {
    contract.PAST_KEY: contract.PRESENT_KEY,
    contract.PAST_VALUE: contract.PRESENT_VALUE,
    contract.PAST_TOKENS: contract.PRESENT_TOKENS,
    **contract.STATE_PRESENT_OF,
}


@dataclass
class RepositoryModel:
    name: str
    backend: str
    files: list[str]
    kind: str  # "engine", "encoder", "generate"
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "backend": self.backend,
            "kind": self.kind,
            "files": self.files,
            "notes": self.notes,
        }


def read_artifact(artifact: Path) -> dict:
    """The artifact's manifest, or a one-line error for a directory that is not an artifact."""
    artifact = Path(artifact)
    if not artifact.is_dir():
        raise TfgraphError(f"'{artifact}' is not a directory; give a tfgraph artifact directory")
    path = artifact / "manifest.json"
    if not path.is_file():
        raise TfgraphError(
            f"'{artifact}' is not a tfgraph artifact (no manifest.json); export one with "
            "`python -m tfgraph export MODEL -o DIR`"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TfgraphError(
            f"'{path}' is not valid JSON ({exc.msg}); export the artifact again"
        ) from None
    if manifest.get("flavour") == "optimum":
        raise TfgraphError(
            f"'{path.parent}' is laid out for Optimum (--flavour optimum), whose growing cache "
            "Triton's models do not batch: export it with the default flavour or --flavour genai"
        )
    if manifest.get("vision_language") and manifest.get("graphs"):
        return manifest  # its decoder's graph is decoder/model.onnx (write_repository)
    if "graphs" not in manifest or "model.onnx" not in manifest["graphs"]:
        raise TfgraphError(f"'{path}' names no model.onnx graph; export the artifact again")
    return manifest


def write_repository(
    artifact: str | Path,
    out: str | Path,
    *,
    name: str | None = None,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    max_sequence: int | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    slots: int | None = None,
    slot_capacity: int | None = None,
    batching: str | None = None,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
    speculative: str | None = None,
    speculative_k: int = 4,
) -> list[RepositoryModel]:
    """Write the repository for ``artifact`` into ``out`` (atomically); the models written.

    ``name``: the engine model's name (default: the artifact directory's). ``max_sequence``:
    the capacity of a shared KV buffer held as Triton state (default: the artifact's
    ``max_positions``, else 2048). ``concurrency``: the most requests the generation model
    decodes in one batch. ``slots`` / ``slot_capacity``: the generation model's cache slots
    for in-flight batching (default: ``concurrency`` slots of the model's positions, at most
    1024), where the artifact takes per-row past lengths; else it batches the requests that
    arrive together (the reason is in the model's notes). ``batching``: ``static`` asks for
    the latter anyway, ``inflight`` refuses an artifact that cannot (default: the best it can).
    ``prefill_chunk``, ``prefix_cache_mb``, ``speculative`` (``prompt-lookup`` or a draft
    artifact, copied beside it), ``speculative_k``: in-flight batching's (tfgraph serve's flags).
    """
    artifact = Path(artifact)
    manifest = read_artifact(artifact)
    name = name or _model_name(artifact)
    _check_arguments(manifest, max_batch_size, concurrency, slots, slot_capacity, batching)
    if prefill_chunk < 0 or prefix_cache_mb < 0:
        raise TfgraphError("--prefill-chunk and --prefix-cache-mb must be >= 0 (0: off)")
    from tfgraph.runtime.inflight_speculative import draft_artifact  # numpy: not at import

    draft = draft_artifact(speculative, speculative_k)
    capacity = max_sequence or manifest.get("max_positions") or 2048
    images = bool(manifest.get("vision_language"))  # the generation model only (module doc)
    with staged_directory(Path(out), MARKER, "Triton repository") as stage:
        models = []
        if not images:
            models = _write_engines(stage, artifact, name, manifest, max_batch_size, capacity)
        if manifest.get("kv_cache"):
            decoder = read_artifact(artifact / "decoder") if images else manifest
            mode = _batching(decoder, concurrency, slots, slot_capacity)
            mode = replace(mode, prefill_chunk=prefill_chunk, prefix_cache_mb=prefix_cache_mb)
            if speculative and mode.mode == "inflight":
                mode = replace(mode, speculative=DRAFT_DIR if draft else speculative,
                               speculative_k=speculative_k, draft=draft)  # fmt: skip
            if batching == "inflight" and mode.mode != "inflight":
                raise TfgraphError(f"in-flight batching is not available: {mode.reason}")
            if batching == "static":
                mode = Batching("static", concurrency, reason="asked for")
            generate = _write_generate(stage, artifact, name + GENERATE_SUFFIX, mode, images)
            models.append(generate)
        for model in models:
            graph = artifact / "model.onnx" if model.backend == "tensorrt_plan" else None
            check_config(stage / model.name / "config.pbtxt", stage / model.name, graph)
        record = {"artifact": str(artifact.resolve()), "models": [m.as_dict() for m in models]}
        (stage / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    logger.info("wrote Triton repository %s: %s", out, ", ".join(m.name for m in models))
    return models


def _check_arguments(manifest, max_batch_size, concurrency, slots, slot_capacity, batching):
    """Refuse sizes and batching modes that cannot be, before anything is written."""
    if max_batch_size < 0 or concurrency < 1:
        raise TfgraphError("--max-batch-size must be >= 0 and --concurrency >= 1")
    if (slots is not None and slots < 1) or (slot_capacity is not None and slot_capacity < 2):
        raise TfgraphError("--slots must be >= 1 and --slot-capacity >= 2")
    if batching not in (None, "inflight", "static"):
        raise TfgraphError(f"--batching is inflight or static, got {batching!r}")
    limit = manifest.get("max_positions")
    if slot_capacity is not None and limit is not None and slot_capacity > limit:
        raise TfgraphError(
            f"--slot-capacity {slot_capacity} is more than the {limit} positions the model "
            "supports (max_positions in manifest.json); lower it"
        )


def _write_engines(stage, artifact, name, manifest, max_batch_size, capacity) -> list:
    """The onnxruntime engine models (the decoder's, an encoder's) and, where the artifact
    holds a TensorRT engine built from model.onnx, its ``tensorrt_plan`` model."""
    graphs = manifest["graphs"]
    providers = manifest.get("target", {}).get("providers", [])
    kind = "GPU" if any(p != "cpu" for p in providers) else "CPU"
    models: list[RepositoryModel] = []
    engine = engine_config(name, graphs["model.onnx"], max_batch_size, kind, capacity)
    models.append(_write_engine(stage, artifact, name, "model.onnx", engine, manifest))
    if contract.ENCODER_FILE in graphs:
        encoder_name = name + ENCODER_SUFFIX
        config = engine_config(
            encoder_name, graphs[contract.ENCODER_FILE], max_batch_size, kind, capacity
        )
        encoder = _write_engine(
            stage, artifact, encoder_name, contract.ENCODER_FILE, config, manifest
        )
        models.append(encoder)
    engine_file = next((f for f in manifest.get("files", []) if f.endswith(ENGINE_SUFFIXES)), None)
    if engine_file is not None:  # a TensorRT engine built from model.onnx
        plan = engine_config(
            name + PLAN_SUFFIX, graphs["model.onnx"], max_batch_size, "GPU", capacity
        ).replace('backend: "onnxruntime"', 'platform: "tensorrt_plan"')
        models.append(_write_plan(stage, artifact, name + PLAN_SUFFIX, engine_file, plan))
    return models


def _model_name(artifact: Path) -> str:
    raw = artifact.resolve().name
    cleaned = "".join(c if c.isalnum() or c in "-_" else "_" for c in raw)
    return cleaned or "model"


# --- the engine (onnxruntime backend) ------------------------------------------------------


def _dims(shape: list, batched: bool) -> list[int]:
    dims = [d if isinstance(d, int) else -1 for d in (shape or [])]
    return dims[1:] if batched else dims


def _batch_axis(graph: dict) -> str | None:
    """The dynamic axis every input and output leads with, if there is one."""
    firsts = {(p.get("shape") or [None])[0] for p in (*graph["inputs"], *graph["outputs"])}
    if len(firsts) == 1:
        (axis,) = firsts
        if isinstance(axis, str):
            return axis
    return None


def _tensor(port: dict, batched: bool) -> str:
    dtype = TRITON_TYPES.get(port.get("dtype"))
    if dtype is None:
        raise TfgraphError(
            f"tensor '{port['name']}' has dtype {port.get('dtype')} that Triton's config has no "
            "type for"
        )
    dims = ", ".join(map(str, _dims(port.get("shape"), batched)))
    return f'  {{ name: "{port["name"]}" data_type: {dtype} dims: [ {dims} ] }}'


def _states(graph: dict, batched: bool, capacity: int) -> tuple[list[str], set[str]]:
    """``state`` entries pairing each past input with its present output; their names."""
    layout = graph.get("kv_layout") or {}
    aliases = {**layout.get("present_aliases_past", {}), **layout.get("present_extends_past", {})}
    by_past = {past: present for present, past in aliases.items()}
    if not by_past:  # pair by role and layer
        outputs = {(p.get("role"), p.get("layer")): p["name"] for p in graph["outputs"]}
        for port in graph["inputs"]:
            if port.get("role") in _PAST:
                present = outputs.get((_PAST[port["role"]], port.get("layer")))
                if present:
                    by_past[port["name"]] = present
    shared = layout.get("kind") in contract.BUFFER_LAYOUTS
    capacity_dim = layout.get("capacity_dim")
    entries, names = [], set()
    for port in graph["inputs"]:
        if port["name"] not in by_past:
            continue
        dtype = TRITON_TYPES[port["dtype"]]
        shape = port.get("shape") or []
        dims = _dims(shape, batched)
        # the initial state: an empty past (length 0) or, for a shared buffer, a zero buffer of
        # the capacity the sequence may reach
        start = [d if isinstance(d, int) else 1 for d in shape]
        for i, d in enumerate(shape):
            if isinstance(d, str) and i > 0:
                start[i] = capacity if shared and d == capacity_dim else 0
        start = start[1:] if batched else start
        entries.append(
            "    {\n"
            f'      input_name: "{port["name"]}"\n'
            f'      output_name: "{by_past[port["name"]]}"\n'
            f"      data_type: {dtype}\n"
            f"      dims: [ {', '.join(map(str, dims))} ]\n"
            "      initial_state: {\n"
            f"        data_type: {dtype}\n"
            f"        dims: [ {', '.join(map(str, start))} ]\n"
            "        zero_data: true\n"
            f'        name: "empty {port["name"]}"\n'
            "      }\n"
            "    }"
        )
        names |= {port["name"], by_past[port["name"]]}
    return entries, names


def engine_config(name: str, graph: dict, max_batch_size: int, kind: str, capacity: int) -> str:
    """``config.pbtxt`` of one ONNX graph for the onnxruntime backend."""
    batched = max_batch_size > 0 and _batch_axis(graph) is not None
    states, state_names = _states(graph, batched, capacity)
    inputs = [_tensor(p, batched) for p in graph["inputs"] if p["name"] not in state_names]
    outputs = [_tensor(p, batched) for p in graph["outputs"] if p["name"] not in state_names]
    lines = [
        f'name: "{name}"',
        'backend: "onnxruntime"',
        f"max_batch_size: {max_batch_size if batched else 0}",
        "input [\n" + ",\n".join(inputs) + "\n]",
        "output [\n" + ",\n".join(outputs) + "\n]",
        f"instance_group [ {{ count: 1 kind: KIND_{kind} }} ]",
    ]
    if states:
        lines.append("sequence_batching {\n  state [\n" + ",\n".join(states) + "\n  ]\n}")
    elif batched:
        lines.append("dynamic_batching { }")
    return "\n".join(lines) + "\n"


def _write_engine(stage, artifact, name, onnx_file, config, manifest) -> RepositoryModel:
    version = stage / name / "1"
    version.mkdir(parents=True)
    files = ["model.onnx"]
    _link(artifact / onnx_file, version / "model.onnx")
    for extra in manifest.get("files", []):  # external data beside its graph
        if extra.startswith(onnx_file) and extra != onnx_file:
            _link(artifact / extra, version / extra)
            files.append(extra)
    (stage / name / "config.pbtxt").write_text(config)
    kind = "encoder" if onnx_file == contract.ENCODER_FILE else "engine"
    notes = ["checked offline (no onnxruntime backend here)"]
    if "sequence_batching" in config:
        notes.append("KV cache as implicit state")
    elif "dynamic_batching" in config:
        notes.append("dynamic batching")
    return RepositoryModel(name, "onnxruntime", files, kind, notes)


def _write_plan(stage, artifact, name, engine_file, config) -> RepositoryModel:
    version = stage / name / "1"
    version.mkdir(parents=True)
    _link(artifact / engine_file, version / "model.plan")
    (stage / name / "config.pbtxt").write_text(config)
    notes = ["checked offline (no TensorRT here)", f"engine {engine_file}"]
    return RepositoryModel(name, "tensorrt_plan", ["model.plan"], "engine", notes)


# --- the generation model (python backend) -------------------------------------------------


@dataclass(frozen=True)
class Batching:
    """How the generation model batches: ``inflight`` over ``slots`` cache slots of
    ``capacity`` positions, or ``static`` (the requests that arrive together, up to
    ``concurrency``; ``reason`` says why not in flight)."""

    mode: str
    concurrency: int
    slots: int = 0
    capacity: int = 0
    kv_bytes_per_position: int = 0
    reason: str = ""
    prefill_chunk: int = 0  # prompt tokens per step (0: each prompt whole)
    prefix_cache_mb: float = 0  # the prefix cache's store (0: off)
    speculative: str = ""  # prompt-lookup or DRAFT_DIR (the draft artifact's copy)
    speculative_k: int = 4
    draft: Path | None = None  # the draft artifact copied into DRAFT_DIR

    def parameters(self) -> dict[str, str]:
        out = {"concurrency": str(self.concurrency), "batching": self.mode}
        if self.mode == "inflight":
            out.update(slots=str(self.slots), slot_capacity=str(self.capacity))
            out.update(prefill_chunk=str(self.prefill_chunk))
            out.update(prefix_cache_mb=f"{self.prefix_cache_mb:g}")
            if self.speculative:
                out.update(speculative=self.speculative, speculative_k=str(self.speculative_k))
        return out

    def notes(self) -> list[str]:
        if self.mode != "inflight":
            return [f"batches up to {self.concurrency} requests that arrive together "
                    f"({self.reason})"]  # fmt: skip
        kv = self.slots * self.capacity * self.kv_bytes_per_position / 2**20
        chunk = f"{self.prefill_chunk} tokens a step" if self.prefill_chunk else "whole"
        prefix = f"{self.prefix_cache_mb:g} MiB" if self.prefix_cache_mb else "off"
        spec = f"; speculative {self.speculative}, k {self.speculative_k}" * bool(self.speculative)
        return [
            f"in-flight batching: {self.slots} slots x {self.capacity} positions "
            f"({kv:.1f} MiB of KV cache); prompts prefilled {chunk}; prefix cache {prefix}{spec}"
        ]


def _batching(manifest: dict, concurrency: int, slots, capacity) -> Batching:
    from tfgraph.runtime.inflight import signature_support

    graph = manifest["graphs"]["model.onnx"]
    signature = contract.signature_from_manifest(manifest)
    reason = signature_support(signature, contract.ENCODER_FILE in manifest["graphs"])
    if reason:
        return Batching("static", concurrency, reason=reason)
    limit = manifest.get("max_positions")
    capacity = capacity or min(limit or DEFAULT_SLOT_CAPACITY, DEFAULT_SLOT_CAPACITY)
    per_position = 0
    for port in graph["inputs"]:
        if port.get("role") in _PAST:
            dims = port.get("shape") or []
            width = dims[1] * dims[3] if len(dims) == 4 and all(
                isinstance(d, int) for d in (dims[1], dims[3])) else 0  # fmt: skip
            per_position += width * (2 if port.get("dtype") == "float16" else 4)
    return Batching("inflight", concurrency, slots or concurrency, capacity, per_position)


def generate_config(
    name: str, tokenizer: bool, batching: Batching | int, paths: list[str], images: bool = False
) -> str:
    inputs = ['  { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] optional: true }']
    if images:  # a vision-language artifact's: the image file's bytes, with a text prompt
        inputs.append('  { name: "image" data_type: TYPE_STRING dims: [ 1 ] optional: true }')
    # a token per response when streaming, else every token in one response
    outputs = ['  { name: "token_id" data_type: TYPE_INT64 dims: [ -1 ] }']
    if tokenizer:
        inputs.append('  { name: "text" data_type: TYPE_STRING dims: [ 1 ] optional: true }')
        outputs.append('  { name: "token_text" data_type: TYPE_STRING dims: [ 1 ] }')
    if isinstance(batching, int):  # static batching of up to this many requests
        batching = Batching("static", batching, reason="asked for")
    parameters = {
        "python_paths": os.pathsep.join(paths),
        **batching.parameters(),
        "batch_wait_ms": str(BATCH_WAIT_MS),
    }
    params = ",\n".join(
        f'  {{ key: "{k}" value {{ string_value: {json.dumps(v)} }} }}'
        for k, v in parameters.items()
    )
    return (
        "\n".join(
            [
                f'name: "{name}"',
                'backend: "python"',
                "max_batch_size: 0",
                "model_transaction_policy { decoupled: true }",
                "input [\n" + ",\n".join(inputs) + "\n]",
                "output [\n" + ",\n".join(outputs) + "\n]",
                "instance_group [ { count: 1 kind: KIND_CPU } ]",
                "parameters [\n" + params + "\n]",
            ]
        )
        + "\n"
    )


def _write_generate(
    stage: Path, artifact: Path, name: str, batching: Batching, images: bool = False
) -> RepositoryModel:
    import tfgraph.runtime.serving.triton_generate as triton_generate

    version = stage / name / "1"
    version.mkdir(parents=True)
    shutil.copyfile(triton_generate.__file__, version / "model.py")
    copy = version / "artifact"
    copy.mkdir()
    for path in sorted(artifact.rglob("*")):
        target = copy / path.relative_to(artifact)
        if path.is_dir():
            target.mkdir(exist_ok=True)
        elif path.is_file():
            _link(path, target)
    if batching.draft is not None:  # beside the artifact: the model resolves it there
        for path in sorted(p for p in batching.draft.rglob("*") if p.is_file()):
            _link(path, copy / DRAFT_DIR / path.relative_to(batching.draft))
    tokenizer = (artifact / "tokenizer").is_dir()
    config = generate_config(name, tokenizer, batching, python_site_paths(), images)
    (stage / name / "config.pbtxt").write_text(config)
    notes = ["streams tokens (decoupled)", *batching.notes()]
    if images:
        notes.append("takes an image (its processor and vision graph run in the model)")
    files = ["model.py", "artifact/"]
    return RepositoryModel(name, "python", files, "generate", notes)


def _link(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (same file system), else copy it."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
