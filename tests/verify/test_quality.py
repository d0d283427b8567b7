"""``measure_quality`` (tfgraph/verify/quality.py) on the committed reference decoder
(bench/reference_model): the fp32 artifact measures as its source does, an int4 one measurably
worse, the windows cut as train_reference's perplexity cuts them; bad inputs refused."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import tfgraph
from tfgraph.errors import TfgraphError
from tfgraph.verify import quality_store
from tfgraph.verify.quality import measure_quality
from tfgraph.verify.quality_store import LogitStore, batches, stacked, windows

REFERENCE = Path(__file__).resolve().parents[2] / "bench" / "reference_model"
HELDOUT = REFERENCE / "heldout.txt"


def short_text(factory) -> Path:
    """The held-out text's first 2,500 characters (about 600 tokens), once per session."""
    path = factory.getbasetemp() / "quality-short.txt"
    if not path.is_file():
        path.write_text(HELDOUT.read_text(encoding="utf-8")[:2500], encoding="utf-8")
    return path


def reference_artifact(factory, name: str, **options) -> Path:
    """The reference model exported with ``options`` into the session's temp dir, once per
    session (the CLI tests use the same ones)."""
    out = factory.getbasetemp() / f"quality-{name}"
    if not (out / "report.json").is_file():
        result = tfgraph.export(REFERENCE, out, **options)
        assert result.passed, result.report["parity"]
    return out


@pytest.fixture(scope="module")
def fp32_artifact(tmp_path_factory) -> Path:
    # exported with quality_text: the export's own quality stage runs on the short text
    text = short_text(tmp_path_factory)
    return reference_artifact(tmp_path_factory, "fp32", kv_cache=True, quality_text=str(text))


def _eager_perplexity(ids: np.ndarray, window: int) -> float:
    """train_reference's own perplexity of the checkpoint over ``ids`` (the figure's code)."""
    import transformers

    from tfgraph.tools.train_reference import perplexity

    model = transformers.AutoModelForCausalLM.from_pretrained(REFERENCE, dtype=torch.float32)
    with torch.no_grad():
        return perplexity(model.eval(), torch.from_numpy(ids), window)


def test_fp32_artifact_measures_as_its_source(fp32_artifact, tmp_path_factory):
    text = short_text(tmp_path_factory)
    got = measure_quality(fp32_artifact, text, window=256, max_tokens=300)
    assert (got["tokens"], got["windows"], got["window"]) == (299, 2, 256)  # last one short
    assert got["ppl"] == pytest.approx(got["ppl_ref"], rel=1e-3)
    assert got["kl_mean"] < 1e-6 and got["top1"] >= 0.999
    assert got["reference"] == f"fp32 eager hf:{REFERENCE}"
    # the fp32 figure is train_reference's perplexity over the same tokens and windows
    from tfgraph.runtime.tokenizer import load_tokenizer

    ids = np.asarray(load_tokenizer(fp32_artifact)(text.read_text())["input_ids"][:300])
    assert got["ppl_ref"] == pytest.approx(_eager_perplexity(ids, 256), rel=1e-4)


def test_export_quality_text_writes_the_report(fp32_artifact, tmp_path_factory):
    report = json.loads((fp32_artifact / "report.json").read_text())
    quality = report["quality"]
    assert quality["artifact"] == str(fp32_artifact)  # where it was published, not the stage
    assert quality["window"] == 512  # the model's 1024 positions, capped
    assert quality["text"] == str(short_text(tmp_path_factory))
    assert quality["ppl"] == pytest.approx(quality["ppl_ref"], rel=1e-3)
    assert quality["tokens"] > 500 and "quality" in report["timings"]


@pytest.mark.slow  # a second export of the reference model: ~20 s, the default tier has no room
def test_int4_costs_perplexity(tmp_path_factory):
    artifact = reference_artifact(
        tmp_path_factory, "int4", kv_cache=True, weights="int4", block_size=32
    )
    got = measure_quality(artifact, short_text(tmp_path_factory), window=256, max_tokens=600)
    assert got["delta_ppl"] > 0 and got["kl_mean"] > 0
    # measurably worse, not broken: a wrong artifact's KL is whole nats, its top-1 near 0
    assert got["kl_mean"] < 0.05 and got["top1"] > 0.85 and got["delta_ppl_pct"] < 5


def test_windows_score_every_token_but_the_first_once():
    spans = windows(10, 4)
    assert spans == [(0, 4), (4, 8), (8, 9)]
    targets = [t for a, b in spans for t in range(a + 1, b + 1)]
    assert targets == list(range(1, 10))
    groups = list(batches(spans, vocab=100, budget=4 * 100 * 4 * 2, cap=None))
    assert groups == [[(0, 4), (4, 8)], [(8, 9)]]  # two longest windows within the budget
    everything = list(batches(spans, vocab=100, budget=1 << 20, cap=None))
    assert everything == [spans]  # the short last window joins: one pass over the weights
    assert list(batches(spans, vocab=100, budget=1, cap=None))[0] == [(0, 4)]
    padded = stacked(np.arange(10), [(4, 8), (8, 9)])
    assert padded.tolist() == [[4, 5, 6, 7], [8, 8, 8, 8]]


def test_logits_kept_on_disk_come_back_and_go(monkeypatch):
    monkeypatch.setattr(quality_store, "IN_MEMORY_BYTES", 0)
    rows = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32)
    with LogitStore(7) as store:
        store.put(4, rows[4:])
        store.put(0, rows[:4])
        np.testing.assert_array_equal(store.get(2, 4), rows[2:6])
        tmp = store._tmp
        assert tmp is not None and tmp.is_dir()
    assert not tmp.exists()


def test_bad_inputs_are_one_line_errors(fp32_artifact, tmp_path):
    with pytest.raises(TfgraphError, match="no text file"):
        measure_quality(fp32_artifact, tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(TfgraphError, match="at least 2"):
        measure_quality(fp32_artifact, empty)
    with pytest.raises(TfgraphError, match="no report.json"):
        measure_quality(tmp_path, HELDOUT)
    bare = tmp_path / "bare"
    shutil.copytree(fp32_artifact, bare, ignore=shutil.ignore_patterns("tokenizer", "*.onnx*"))
    with pytest.raises(TfgraphError, match="with a tokenizer"):
        measure_quality(bare, HELDOUT)
    with pytest.raises(TfgraphError, match="past the model's 1024 positions"):
        measure_quality(fp32_artifact, HELDOUT, window=2048)


def test_export_refuses_quality_text_early(tmp_path):
    with pytest.raises(TfgraphError, match="no text file"):
        tfgraph.export(REFERENCE, tmp_path / "a", quality_text=str(tmp_path / "missing.txt"))
    with pytest.raises(TfgraphError, match="needs a tokenizer"):  # a preset carries none
        tfgraph.export("gpt-tiny", tmp_path / "b", quality_text=str(HELDOUT))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow  # the whole held-out text through artifact and eager: ~35 s on 2 cores
def test_heldout_perplexity_is_the_stated_figure(fp32_artifact):
    figures = json.loads((REFERENCE / "figures.json").read_text())
    got = measure_quality(fp32_artifact, HELDOUT, window=figures["context"])
    assert got["tokens"] == figures["heldout_tokens"] - 1
    assert got["ppl_ref"] == pytest.approx(figures["heldout_ppl"], rel=0.01)
    assert got["ppl"] == pytest.approx(got["ppl_ref"], rel=1e-3) and got["top1"] >= 0.999


@pytest.mark.slow  # a cacheless export traces the model again: ~30 s
def test_cacheless_artifact(tmp_path_factory):
    artifact = reference_artifact(tmp_path_factory, "nocache", kv_cache=False)
    got = measure_quality(artifact, short_text(tmp_path_factory), window=128, max_tokens=300)
    assert got["windows"] == 3 and got["tokens"] == 299
    assert got["ppl"] == pytest.approx(got["ppl_ref"], rel=1e-3)
    assert got["kl_mean"] < 1e-6 and not math.isnan(got["kl_max"])
