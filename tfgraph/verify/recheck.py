"""``python -m tfgraph parity ARTIFACT``: re-check an artifact against its source, and when an
output fails, bisect to the first PyTorch module whose output diverges.

The source is the one ``report.json`` names (a preset, a factory, a Hugging Face directory);
the precision is the manifest's, and a quantized artifact is checked against eager with the
weights dequantized from the artifact itself
(:func:`tfgraph.exporters.ort.weights.quantize.reference_from_artifact`).
Parity runs as at export time, on this machine and with this ONNX Runtime.

**Bisection** (:func:`bisect`). A copy of the graph exposes, for every module of the eager
model, the value its subgraph hands on (the output of the module's nodes — the nodes whose
PyTorch scope is the module or inside it — that a node outside reads, with the eager output's
shape); forward hooks record each module's eager output on the same inputs (attention masks
all ones, an empty cache). The modules are compared in the order they finish in eager, so an
inner module (``decoder.blocks.1.attn``) is named before the block that holds it; the first
one outside tolerance is the culprit, with the kernels (fused nodes) inside it. In fp16 the
tolerance is the precision's rule against eager fp16
(:func:`tfgraph.precision.islands.judge`); where
the artifact's MatMulNBits quantize activations (accuracy level 4) it is the rule of
:func:`tfgraph.verify.activation_rule.judge_activations`, module by module.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import onnx_ir as ir

from tfgraph import contract
from tfgraph.errors import TfgraphError
from tfgraph.passes.provenance import module_name
from tfgraph.runtime.session import checked_model, model_path
from tfgraph.verify.parity import FP32, compare

logger = logging.getLogger(__name__)

RESULT_FILE = "parity.json"


def read_report(directory: Path, needs: str) -> dict:
    """The artifact's ``report.json``, refused in one line when it is absent or names no
    source (``needs``: the command that needs it, for the message)."""
    file = directory / "report.json"
    if not file.is_file():
        raise TfgraphError(
            f"'{directory}' has no report.json: {needs} needs the artifact directory tfgraph "
            "export wrote (it names the source)"
        )
    report = json.loads(file.read_text())
    if not str(report.get("model", "")).partition(":")[2]:
        raise TfgraphError(f"'{file}' names no source ({report.get('model')!r}); export it again")
    return report


def load_artifact_source(directory: Path, *, trust_remote_code: bool = False):
    """(source, reference, report, manifest): the source ``report.json`` names and the eager
    reference parity uses (the dequantized weights of a quantized artifact)."""
    from tfgraph.exporters.ort.weights.quantize import reference_from_artifact
    from tfgraph.sources import load_source, vision_language

    report = read_report(directory, "re-check")
    origin = report["model"]
    _, _, spec = origin.partition(":")
    info = report.get("source") or {}
    if origin.startswith(f"{vision_language.ORIGIN}:"):  # a graph of a vision-language model
        source = vision_language.graph_source(spec, trust_remote_code=trust_remote_code)
    else:
        source = load_source(
            spec,
            trust_remote_code=trust_remote_code,
            attn_implementation=info.get("attn_fallback") or None,
        )
    if info.get("static_axes_flag"):  # exported with --static-axes: checked at those sizes
        from tfgraph.sources.static_axes import with_static_axes

        source = with_static_axes(source, info["static_axes_flag"])
    model_file, manifest = checked_model(directory)
    reference = source
    weights = report.get("weights")
    if weights:
        reference = reference_from_artifact(source, model_file, weights["parameters"])
    return source, reference, report, manifest or {}


def recheck(directory: str | Path, *, trust_remote_code: bool = False, bisect_failures=True):
    """Parity of the artifact in ``directory`` on this machine; on failure the bisection.
    Writes ``parity.json`` beside it and returns what it holds."""
    from tfgraph.verify.cache_parity import check_cache_parity
    from tfgraph.verify.parity import PARITY_SHAPES, check_parity

    directory = Path(directory)
    source, reference, report, manifest = load_artifact_source(
        directory, trust_remote_code=trust_remote_code
    )
    precision = manifest.get("precision", "fp32")
    model_file = model_path(directory)  # the manifest's step graph (a flavour's folder)
    shapes = [tuple(s) for s in report.get("parity", {}).get("shapes", PARITY_SHAPES)]
    check = check_cache_parity if report.get("kv_cache") else check_parity
    parity = check(reference, model_file, shapes=shapes, precision=precision)
    result = {
        "model": report.get("model"),
        "precision": precision,
        "eager_device": parity["eager_device"],
        "parity": parity,
    }
    if (manifest.get("target") or {}).get("runner") == "tensorrt":  # an engine: a 2nd opinion
        result["onnxruntime_check"] = engine_vs_onnxruntime(reference, model_file, shapes)
        parity["passed"] = parity["passed"] and result["onnxruntime_check"]["passed"]
    if not parity["passed"] and bisect_failures:
        result["bisect"] = bisect(reference, model_file, precision)
    (directory / RESULT_FILE).write_text(json.dumps(result, indent=2, default=float) + "\n")
    return result


def engine_vs_onnxruntime(source, model_file: Path, shapes) -> dict:
    """A TensorRT engine against ONNX Runtime on the ONNX graph it was built from, on the
    parity inputs (``polygraphy run --trt --onnxrt``'s comparison): one row per output and
    shape, fp32 tolerance, 10x looser for an fp16/bf16 engine."""
    from tfgraph.runtime import Session, open_runner
    from tfgraph.verify.parity import FP32, Tolerance, compare

    engine = open_runner(model_file, runner="tensorrt")
    session = Session(model_file, providers=("cpu",))
    low = (json.loads((model_file.parent / "manifest.json").read_text()).get("precision")
           or "fp32") != "fp32"  # fmt: skip
    tolerance = Tolerance(FP32.atol * 10, FP32.rtol * 10) if low else FP32
    rows = []
    for i, (batch, seq) in enumerate(shapes):
        inputs = {
            n: v for n, v in source.inputs(batch, seq, seed=i).items() if n in session.input_names
        }
        if any(n not in inputs for n in session.input_names):  # a cached graph: a prefill
            rows += _prefill_rows(engine, session, source, batch, seq, i, tolerance)
            continue
        want, got = session.run(inputs), engine.run(inputs)
        rows += [compare(n, got[n], want[n], tolerance) for n in want]
    return {"passed": bool(rows) and all(r["passed"] for r in rows), "rows": rows}


def _prefill_rows(engine, session, source, batch, seq, seed, tolerance) -> list[dict]:
    """The logits of a prefill step (empty cache) from both runners; an encoder-decoder's
    step needs its encoder's outputs and is not compared (a row says so)."""
    import numpy as np

    from tfgraph.runtime import CachedDecoder
    from tfgraph.verify.parity import compare

    decoders = [CachedDecoder(engine), CachedDecoder(session)]
    if decoders[1].seq2seq:
        return [{"name": "logits", "passed": False, "error": "encoder-decoder: not compared"}]
    inputs = source.inputs(batch, seq, seed=seed)
    tokens = inputs[decoders[1].token_input].numpy()
    mask = decoders[1].mask_input
    mask = inputs[mask].numpy() if mask is not None and mask in inputs else None
    logits = []
    for decoder in decoders:
        out, _ = decoder.step(tokens, decoder.empty_cache(batch, seq), mask, {})
        logits.append(np.asarray(decoder.session.to_numpy(out)))
    return [compare("logits", logits[0], logits[1], tolerance)]


FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


def _module_values(model: ir.Model) -> tuple[dict, dict]:
    """Module name → the values its nodes hand to nodes outside it, and → the values they
    read from outside it (graph order)."""
    scopes = {id(n): module_name(n) for n in model.graph}
    prefixes = set()
    for name in {s for s in scopes.values() if s}:
        parts = name.split(".")
        prefixes.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    outputs = set(model.graph.outputs)
    handed_by: dict[str, list[ir.Value]] = {}
    read_by: dict[str, list[ir.Value]] = {}
    for prefix in prefixes:

        def inside(node: ir.Node | None, prefix=prefix) -> bool:
            scope = scopes.get(id(node), "") if node is not None else ""
            return scope == prefix or scope.startswith(prefix + ".")

        handed, read = [], []
        for node in model.graph:
            if not inside(node):
                continue
            for value in node.inputs:
                if value is None or value.dtype not in FLOATS or value.const_value is not None:
                    continue
                if not inside(value.producer()) and value not in read:
                    read.append(value)
            for out in node.outputs:
                if out.dtype in FLOATS and (
                    out in outputs or any(not inside(u.node) for u in out.uses())
                ):
                    handed.append(out)
        if handed:
            handed_by[prefix] = handed
        if read:
            read_by[prefix] = read
    return handed_by, read_by


def _eager_outputs(source, inputs: dict, dtype=None) -> list[tuple]:
    """(module name, output, first tensor input or None) in the order modules finish; modules
    returning several tensors (RoPE's cos and sin) are left out."""
    import torch

    module = source.module if dtype is None else source.converted(dtype)
    order: list[tuple] = []
    hooks = []

    def array(t):
        ok = isinstance(t, torch.Tensor) and t.is_floating_point()
        return t.detach().float().cpu().numpy() if ok else None

    for name, sub in module.named_modules():
        if not name:
            continue

        def hook(_module, args, output, name=name):
            if isinstance(output, (tuple, list)):  # which graph value is which: not known
                return
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if array(output) is not None:
                order.append((name, array(output), array(first)))

        hooks.append(sub.register_forward_hook(hook))
    try:
        cast = {
            n: v.to(dtype) if dtype is not None and v.is_floating_point() else v
            for n, v in inputs.items()
        }
        source.call(module, cast)  # each input bound as the source binds it
    finally:
        for h in hooks:
            h.remove()
    return order


def bisect(source, model_file: Path, precision: str = "fp32", shape=(1, 7)) -> dict:
    """The first module (in eager finishing order) whose graph value leaves tolerance."""
    import torch

    from tfgraph.exporters.ort.weights.activations import (
        activation_quantization_off,
        quantizes_activations,
    )
    from tfgraph.precision.islands import TORCH_TYPES, island_feeds, judge, run_exposed
    from tfgraph.verify.activation_rule import judge_activations

    model = ir.load(model_file)
    feeds = island_feeds(model, source, [shape])
    inputs = source.inputs(*shape, seed=0)
    masks = set(
        contract.names_with_role(model, contract.ATTENTION_MASK, contract.ENCODER_ATTENTION_MASK)
    )
    inputs = {n: torch.ones_like(v) if n in masks else v for n, v in inputs.items()}
    handed, read = _module_values(model)
    exposed = sorted({v.name for vs in (*handed.values(), *read.values()) for v in vs})
    graph_values = run_exposed(model, exposed, feeds)[0]
    low = {}
    if precision != "fp32":
        low = {n: (o, i) for n, o, i in _eager_outputs(source, inputs, TORCH_TYPES[precision])}
    bracketed = precision != "fp32" or quantizes_activations(source)
    if precision == "fp32" and bracketed:  # the reference without activation quantization
        with activation_quantization_off(source):
            low = {n: (o, i) for n, o, i in _eager_outputs(source, inputs)}

    def judged(name: str, candidates: list, want, want_low) -> dict | None:
        names = [
            v.name
            for v in candidates
            if v.name in graph_values and graph_values[v.name].shape == want.shape
        ]
        if not names:
            return None
        got = graph_values[names[-1]]
        if not bracketed:
            row = compare(name, got, want, FP32)
        elif precision == "fp32":
            row = judge_activations(got, want, want_low if want_low is not None else want)
        else:
            row = judge(got, want, want_low if want_low is not None else want, precision)
        return {
            "module": name,
            "value": names[-1],
            "max_abs_err": row["max_abs_err"],
            "max_rel_err": row["max_rel_err"],
            "passed": row["passed"],
        }

    checked = []
    for name, want, want_in in _eager_outputs(source, inputs):
        row = judged(name, handed.get(name, []), want, low.get(name, (None, None))[0])
        if row is None:
            continue
        checked.append(row)
        if row["passed"]:
            continue
        # an output that diverges from an input that already did: the divergence came from
        # the enclosing module's own nodes, between its children
        culprit = name
        if want_in is not None and "." in name:
            seen = judged(name, read.get(name, []), want_in, low.get(name, (None, None))[1])
            if seen is not None and not seen["passed"]:
                culprit = name.rsplit(".", 1)[0]
                row = {**row, "module": culprit, "diverging_input_of": name}
        found = {**row, "kernels": _kernels(model, culprit)}
        return {"first_divergence": found, "checked": checked}
    return {"first_divergence": None, "checked": checked}


FUSED_STANDARD = {"Attention", "LayerNormalization", "RMSNormalization", "Gelu"}


def _kernels(model: ir.Model, name: str) -> list[dict]:
    """The fused kernels a module's nodes hold, its own scope first."""
    found = []
    for n in model.graph:
        scope = module_name(n)
        fused = n.domain not in ("", "ai.onnx") or n.op_type in FUSED_STANDARD
        if fused and (scope == name or scope.startswith(name + ".")):
            found.append({"op": n.op_type, "node": n.name, "module": scope})
    found.sort(key=lambda k: k["module"] != name)
    return found
