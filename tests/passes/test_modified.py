"""``modified`` tells the truth both ways, for every pass the project defines (issue 45).

Every ``onnx_ir`` pass class under ``passes/`` and ``exporters/`` (found by walking the two
packages: a new pass fails :func:`test_every_pass_class_has_a_case` until it gets a case here)
runs at its place in a pipeline, on a graph built from the project's presets: the preset is
traced for a target and goes through that target's default pipeline, and the pass is checked
where the pipeline reaches it. There it applies, so it must say ``modified=True`` and the
serialized model must differ; run again at once on its own output it has nothing left to do,
so it must say ``modified=False`` and leave the serialized model byte for byte as it was.

Where no preset has what a pass rewrites, the graph comes from a tiny Hugging Face config
made here (no download): RoPE that ``FoldRotaryPass`` folds (a Llama with head size 16; the
presets' rotary tables are not built from one angle table) and recurrent layers (Mamba) for
the recurrent-state passes. Passes that no pipeline runs get the graph they meet in an
export: ``ConvertPrecisionPass`` the finished ``ort-cuda`` graph (``--precision fp16``),
``PagedAttentionPass`` that graph in fp16 (``--kv-layout paged``), and
``ExpandAttentionMaskPass`` an SDPA encoder as traced at opset 23, whose ONNX ``Attention``
masks broadcast over the queries (what the pass meets when recognition leaves one).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field

import onnx
import onnx_ir as ir
import pytest
import torch

from tfgraph import contract
from tfgraph.exporters.ort.paged_attention import PagedAttentionPass
from tfgraph.exporters.targets import get_target
from tfgraph.passes import PipelineOptions, build_pipeline
from tfgraph.passes.lower.convert_precision import ConvertPrecisionPass
from tfgraph.passes.lower.expand_attention_mask import ExpandAttentionMaskPass
from tfgraph.sources import load_source
from tfgraph.sources.trace import trace

PASS_PACKAGES = ("tfgraph.passes", "tfgraph.exporters")


def project_pass_classes() -> dict[str, type]:
    """Every ``onnx_ir`` pass class defined in the project's pass packages, by class name."""
    found: dict[str, type] = {}
    for package_name in PASS_PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package_name}."):
            module = importlib.import_module(info.name)
            for obj in vars(module).values():
                if (
                    inspect.isclass(obj)
                    and issubclass(obj, ir.passes.PassBase)
                    and obj.__module__ == module.__name__
                ):
                    found[obj.__name__] = obj
    return found


def _hf_llama(root) -> str:
    """A Llama whose rotation ``FoldRotaryPass`` folds into GroupQueryAttention (head 16)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).eval().save_pretrained(root / "llama")
    return str(root / "llama")


def _hf_mamba(root) -> str:
    """Recurrent layers only (Mamba-1): the recurrent-state passes' graph."""
    transformers = pytest.importorskip("transformers")
    from tfgraph.tools.tiny_configs import tiny_config

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("mamba", "causal-lm"))
        model.eval().save_pretrained(root / "mamba")
    return str(root / "mamba")


@dataclass(frozen=True)
class Graph:
    """A model traced for ``target`` (at ``opset``, else the target's), through the target's
    default pipeline (``pipeline=False``: as traced), then through ``after``'s passes."""

    model: str | Callable  # a preset name, or a builder of a Hugging Face directory
    target: str
    kv_cache: bool = True
    opset: int | None = None
    pipeline: bool = True
    after: Callable[[], list] = field(default=lambda: [])


GRAPHS = {
    # opset 18: GELU traced as its formula (Gelu is an op from opset 20), so it is fused
    "gpt-tiny, ort-cuda, cached, fp16, paged": Graph(
        "gpt-tiny",
        "ort-cuda",
        opset=18,
        after=lambda: [ConvertPrecisionPass(ir.DataType.FLOAT16), PagedAttentionPass(16)],
    ),
    "shaw-tiny, onnx, cached": Graph("shaw-tiny", "onnx"),
    "bert-tiny-sdpa traced at opset 23": Graph(
        "bert-tiny-sdpa",
        "onnx",
        kv_cache=False,
        opset=23,
        pipeline=False,
        after=lambda: [ExpandAttentionMaskPass()],
    ),  # fmt: skip
    "Hugging Face Llama (head 16), ort, cached": Graph(_hf_llama, "ort"),
    "Hugging Face Mamba, ort, cached": Graph(_hf_mamba, "ort"),
}

# pass class → the graph it applies to
CASES = {
    "FuseNormsPass": "gpt-tiny, ort-cuda, cached, fp16, paged",
    "FuseGeluPass": "gpt-tiny, ort-cuda, cached, fp16, paged",
    "FuseAttentionPass": "gpt-tiny, ort-cuda, cached, fp16, paged",
    "ClassifyAttentionBiasPass": "gpt-tiny, ort-cuda, cached, fp16, paged",
    "InsertKVCachePass": "gpt-tiny, ort-cuda, cached, fp16, paged",
    "LowerNormsPass": "gpt-tiny, ort-cuda, cached, fp16, paged",
    "LowerGeluPass": "gpt-tiny, ort-cuda, cached, fp16, paged",
    "LowerAttentionPass": "gpt-tiny, ort-cuda, cached, fp16, paged",
    "ShareKVBufferPass": "gpt-tiny, ort-cuda, cached, fp16, paged",
    "KernelLayoutsPass": "gpt-tiny, ort-cuda, cached, fp16, paged",
    "PackQKVPass": "gpt-tiny, ort-cuda, cached, fp16, paged",
    "ConvertPrecisionPass": "gpt-tiny, ort-cuda, cached, fp16, paged",
    "PagedAttentionPass": "gpt-tiny, ort-cuda, cached, fp16, paged",
    "GatherAfterContractionPass": "shaw-tiny, onnx, cached",
    "StaticKVCachePass": "shaw-tiny, onnx, cached",
    "ExpandAttentionMaskPass": "bert-tiny-sdpa traced at opset 23",
    "FoldRotaryPass": "Hugging Face Llama (head 16), ort, cached",
    "InsertRecurrentStatePass": "Hugging Face Mamba, ort, cached",
    "LowerRecurrentPass": "Hugging Face Mamba, ort, cached",
}


@dataclass(frozen=True)
class Outcome:
    """What a pass said and did: run once where it applies, then again on its own output."""

    modified: bool
    changed: bool
    again_modified: bool
    again_changed: bool
    before: bytes  # the serialized model the pass met


def _serialized(model: ir.Model) -> bytes:
    return ir.to_proto(model).SerializeToString()


def _run(model: ir.Model, passes: list, outcomes: dict[str, Outcome]) -> None:
    """Run ``passes`` in order; the first pass of each case's class in them is run twice and
    its :class:`Outcome` recorded."""
    for p in passes:
        name = type(p).__name__
        if name not in CASES or name in outcomes:
            p(model)
            continue
        before = _serialized(model)
        modified = p(model).modified
        after = _serialized(model)
        again_modified = p(model).modified
        again_changed = _serialized(model) != after
        outcomes[name] = Outcome(modified, after != before, again_modified, again_changed, before)


def _outcomes(graph: Graph, root) -> dict[str, Outcome]:
    spec = graph.model if isinstance(graph.model, str) else graph.model(root)
    source = load_source(spec)
    target = get_target(graph.target)
    model = trace(source, opset=graph.opset or target.opset)
    passes = []
    if graph.pipeline:
        options = PipelineOptions(
            kv_cache=graph.kv_cache, max_positions=source.info.get("max_positions")
        )
        passes = build_pipeline(target, options)
    outcomes: dict[str, Outcome] = {}
    _run(model, [*passes, *graph.after()], outcomes)
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """The outcomes on a graph of :data:`GRAPHS`, each graph built once."""
    built: dict[str, dict[str, Outcome]] = {}

    def of(key: str) -> dict[str, Outcome]:
        if key not in built:
            built[key] = _outcomes(GRAPHS[key], tmp_path_factory.mktemp("modified"))
        return built[key]

    return of


def test_every_pass_class_has_a_case():
    assert set(project_pass_classes()) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_modified_is_true_where_the_pass_applies_and_false_where_it_does_not(name, outcomes):
    graph = CASES[name]
    outcome = outcomes(graph).get(name)
    assert outcome is not None, f"{name} did not run on {graph}"
    said, did = outcome.modified, outcome.changed
    assert said == did, f"{name} on {graph}: modified={said}, but the graph changed={did}"
    assert did, f"{name} does not apply to {graph}: the case needs another graph"
    said, did = outcome.again_modified, outcome.again_changed
    assert said == did, f"{name} again on its output: modified={said}, but changed={did}"
    assert not did, f"{name} rewrote its own output again ({graph}): no graph it leaves alone"


@pytest.mark.parametrize("name", ["ShareKVBufferPass", "StaticKVCachePass"])
def test_a_cache_left_copying_still_reports_what_was_removed(name, outcomes):
    """The buffer passes remove what lowering left dead before they decide; where the cache
    then stays copying (here a past is also read by an extra output), that removal is still a
    change of the graph, and ``modified`` says so."""
    graph = CASES[name]
    model = ir.from_proto(onnx.ModelProto.FromString(outcomes(graph)[name].before))
    keys = contract.names_with_role(model, contract.PAST_KEY)
    past = next(v for v in model.graph.inputs if v.name in keys)
    dead, reader = ir.node("Neg", [past]), ir.node("Identity", [past])
    out = reader.outputs[0]
    out.name, out.type, out.shape = "past_read_elsewhere", past.type, past.shape
    model.graph.extend([dead, reader])
    model.graph.outputs.append(out)
    before = _serialized(model)
    result = project_pass_classes()[name]()(model)
    assert not contract.names_with_role(model, contract.PAST_LENGTH), "the cache stays copying"
    assert all(node is not dead for node in model.graph), "the dead node is removed"
    assert _serialized(model) != before
    assert result.modified, f"{name} removed a node but said modified=False"
