"""Fixtures shared by every test module, and the per-pass checks of the modules that earn them.

The slow tier (``python -m pytest -m slow``) is marked at the tests themselves:
``@pytest.mark.slow`` on a whole test, ``pytest.param(..., marks=pytest.mark.slow)`` on the
slow cases of a sweep, each with its reason in a comment. The default tier (the README's test
command) keeps a few representative cases of every sweep, so that each target, each precision
and weight format, the KV cache on a decoder and an encoder-decoder, generation, Triton,
re-check, the CLI and bad inputs stay covered there; it must stay under 20 minutes on a 2-core
machine. Both tiers run in full on the same install; neither skips anything.
"""

import pytest
import torch

import tfgraph
from tfgraph.passes.pipeline.run import CHECK_EACH_PASS_ENV

# Exports in the tests check each pass (ONNX checker, strict shape inference and the parity
# probe of tfgraph.passes.pipeline.run): measured, about +0.5 s per gpt-tiny export and +1.5 s per
# t5-tiny export. It earns that time where passes are what a module tests. Left out: modules
# that time exports (bench) or run many of them (fuzz), and those that test what comes after
# the pipeline — generation, serving, precision and weights, re-checks, sources — on graphs
# whose passes the checked modules (zoo pipelines, fusion, recognition, lowering) prove.
# Matched against the module's file name, wherever its folder.
UNCHECKED_MODULES = (
    "test_bench_",
    "test_fuzz",
    "test_generation_parity",
    "test_generate_runtime",
    "test_hf_batched_generation",
    "test_hf_inputs",
    "test_manifest_roles",
    "test_precision",
    "test_weights",
    "test_bf16",
    "test_recheck",
    "test_triton_",
    "test_inflight",
    "test_export_sources",
    "test_streamed_checkpoints",
    "test_old_checkpoints",
    "test_quantized_cache_rows",
    "test_chunked_reference",
)


@pytest.fixture(scope="module", autouse=True)
def check_each_pass(request):
    """Module-scoped so that module fixtures (artifacts shared by a file) are checked too."""
    if request.module.__name__.rpartition(".")[2].startswith(UNCHECKED_MODULES):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CHECK_EACH_PASS_ENV, "1")
        yield


@pytest.fixture(scope="session")
def gpt_artifact(tmp_path_factory):
    """One exported gpt-tiny artifact shared by the tests that only read it."""
    out = tmp_path_factory.mktemp("artifacts") / "gpt-tiny"
    result = tfgraph.export("gpt-tiny", out, check_each_pass=True)
    return result


@pytest.fixture(scope="session")
def hf_gpt2_dir(tmp_path_factory):
    """A random-init GPT-2 saved with save_pretrained (no download)."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4)  # the exact config
    with torch.random.fork_rng():  # seeded: the same weights in every run, whatever ran before
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(config).eval().save_pretrained(path)
    return path
