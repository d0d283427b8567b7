"""TensorRT engines from an artifact: ``python -m tfgraph engine DIR``.

The artifact's ``model.onnx`` (exported with ``--target tensorrt[@X.Y]``) goes through
TensorRT's Python API: ``Builder`` → network (strongly typed on TensorRT ≥ 11, where the ONNX
file carries the precision; on 10.x the fp16/bf16 builder flags follow the manifest's
precision) → ``OnnxParser`` (its errors reported per node with the PyTorch module) → one
optimization profile whose min/opt/max come from the manifest's dims (:func:`engine_profiles`)
→ ``build_serialized_network``. A timing cache (``timing.cache``) is kept beside the artifact
and reused. The engines (``model.plan``, and ``encoder.plan`` for an encoder-decoder) and their
profiles go into the artifact and the manifest (``engine``); the manifest's runner becomes
``tensorrt`` (:mod:`tfgraph.runtime.tensorrt_runner`).

Before building, the static compatibility check (:mod:`tfgraph.exporters.tensorrt.compat`)
refuses graphs with nodes the parser is known to reject.

TensorRT cannot be installed on the machines this project is developed on: only the profile
computation and the refusals are tested here; ``tools/gpu_check.sh`` runs the whole path on a
machine with a GPU and TensorRT.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from tfgraph import contract
from tfgraph.errors import TfgraphError

logger = logging.getLogger(__name__)

TIMING_CACHE = "timing.cache"


@dataclass(frozen=True)
class ProfileOptions:
    """(min, opt, max) of the dynamic axes an engine accepts."""

    batch: tuple[int, int, int] = (1, 1, 8)
    sequence: tuple[int, int, int] = (1, 128, 1024)  # new tokens per step (prefill to decode)
    capacity: int = 2048  # KV positions: a static buffer's length, the most a past may hold

    def check(self) -> None:
        for name in ("batch", "sequence"):
            lo, opt, hi = getattr(self, name)
            if not 1 <= lo <= opt <= hi:
                raise TfgraphError(f"--{name} {lo},{opt},{hi}: need 1 <= min <= opt <= max")
        if self.capacity < self.sequence[2]:
            raise TfgraphError(
                f"--capacity {self.capacity} is below the longest sequence {self.sequence[2]}"
            )


def engine_profiles(graph: dict, options: ProfileOptions) -> dict[str, dict]:
    """Per input of a manifest graph (``manifest["graphs"]["model.onnx"]``): its ``min``,
    ``opt`` and ``max`` shapes, and for the past-length input (a shape tensor) its values."""
    options.check()
    cap = options.capacity
    axes = {
        "batch": options.batch,
        contract.BUFFER_DIM: (1, cap, cap),  # static and shared buffers: the full capacity
        contract.PAST_DIM: (0, options.sequence[1], cap - 1),
        contract.TOTAL_DIM: (1, options.sequence[1] + 1, cap),
    }
    profiles = {}
    for port in graph["inputs"]:
        name, shape = port["name"], port.get("shape") or []
        if port.get("role") == contract.PAST_LENGTH:
            profiles[name] = {"shape": [1], "values": ([0], [options.sequence[1]], [cap - 1])}
            continue
        dims = []
        for dim in shape:
            if isinstance(dim, int):
                dims.append((dim, dim, dim))
            else:
                dims.append(axes.get(dim, options.sequence))  # a token axis by default
        profiles[name] = {
            "min": [d[0] for d in dims],
            "opt": [d[1] for d in dims],
            "max": [d[2] for d in dims],
        }
    return profiles


def _tensorrt():
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise TfgraphError(
            "TensorRT is not installed here (its libraries are not on the package index as "
            "wheels): build engines on a machine with a GPU and TensorRT (tools/gpu_check.sh)"
        ) from exc
    return trt


def build_engine(
    artifact: str | Path,
    options: ProfileOptions = ProfileOptions(),
    *,
    workspace_gib: float = 4.0,
) -> Path:
    """Build ``artifact/model.plan`` (and ``encoder.plan``); update the manifest. Returns the
    step engine's path."""
    from tfgraph.exporters.manifest import read_manifest
    from tfgraph.exporters.targets import get_target

    artifact = Path(artifact)
    manifest = read_manifest(artifact)
    if manifest is None:
        raise TfgraphError(f"'{artifact}' is not a tfgraph artifact (no manifest.json)")
    target = manifest.get("target") or {}
    if target.get("name") != "tensorrt":
        raise TfgraphError(
            f"'{artifact}' was exported for target '{target.get('label')}': export it with "
            "--target tensorrt[@X.Y] to build an engine"
        )
    import onnx_ir as ir

    onnx_file = artifact / "model.onnx"
    findings = get_target(target["label"]).compatibility(ir.load(onnx_file))
    refused = [f for f in findings if f["severity"] == "error"]
    if refused:
        f = refused[0]
        raise TfgraphError(
            f"TensorRT {target['label']} refuses {f['op']} in {f['module'] or f['node']}: "
            f"{f['reason']}; {f['fix']}"
        )
    trt = _tensorrt()
    major = int(trt.__version__.split(".")[0])
    precision = manifest.get("precision", "fp32")
    cache_file = artifact / TIMING_CACHE
    built = {}
    for graph_file in manifest["graphs"]:  # model.onnx, and an encoder-decoder's encoder.onnx
        engine_file = Path(graph_file).with_suffix(".plan").name
        profiles = engine_profiles(manifest["graphs"][graph_file], options)
        serialized, cache = _build(trt, major, artifact / graph_file, profiles, precision,
                                   cache_file, workspace_gib)  # fmt: skip
        (artifact / engine_file).write_bytes(bytes(serialized))
        cache_file.write_bytes(bytes(cache.serialize()))
        built[graph_file] = {"file": engine_file, "profiles": profiles}
    manifest["engine"] = {
        "tensorrt": trt.__version__,
        "strongly_typed": major >= 11,
        "precision": precision,
        "profile": asdict(options),
        "graphs": built,
    }
    files = {*manifest.get("files", []), *(b["file"] for b in built.values())}
    manifest["files"] = sorted(files)
    manifest["target"] = {**target, "runner": "tensorrt"}
    (artifact / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return artifact / built["model.onnx"]["file"]


def _build(trt, major, onnx_file, profiles, precision, cache_file, workspace_gib):
    """(the serialized engine of one graph, the timing cache after it)."""
    import onnx_ir as ir

    log = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(log)
    flags = 0
    if major >= 11:  # precision comes from the graph
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, log)
    if not parser.parse_from_file(str(onnx_file)):
        raise TfgraphError(_parser_error(parser, ir.load(onnx_file)))
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    if major < 11 and precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif major < 11 and precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    cache = config.create_timing_cache(cache_file.read_bytes() if cache_file.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    profile = builder.create_optimization_profile()
    for name, p in profiles.items():
        if "values" in p:
            profile.set_shape_input(name, *p["values"])
        else:
            profile.set_shape(name, p["min"], p["opt"], p["max"])
    config.add_optimization_profile(profile)
    logger.info("building a TensorRT %s engine for %s", trt.__version__, onnx_file)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise TfgraphError(f"TensorRT could not build an engine for '{onnx_file}' (see its log)")
    return serialized, config.get_timing_cache()


def _parser_error(parser, model) -> str:
    """The parser's first error, with the PyTorch module of the node it names."""
    from tfgraph.passes.provenance import module_name

    modules = {n.name: module_name(n) for n in model.graph}
    lines = []
    for i in range(parser.num_errors):
        error = parser.get_error(i)
        node = error.node_name() if hasattr(error, "node_name") else ""
        where = f"node {node} ({modules.get(node) or 'no module'})" if node else "the graph"
        lines.append(f"TensorRT's parser refuses {where}: {error.desc()}")
    return lines[0] if lines else "TensorRT's parser refused the graph"
