"""The coverage matrix (``python -m tfgraph coverage``) on a fixed subset of architectures of
different kinds: each is built tiny from its config, exported as a user would, and must be
complete (every attention layer fused, parity, and for decoders a KV cache whose 32 greedy
tokens equal Hugging Face ``generate``). The full run is long and stays outside CI."""

import json

import pytest

from tfgraph import coverage
from tfgraph.cli import main

pytest.importorskip("transformers")

SUBSET = {
    "gpt2": "causal-lm",
    "llama": "causal-lm",
    "mistral": "causal-lm",
    "bloom": "causal-lm",
    "t5": "seq2seq-lm",
    "bart": "seq2seq-lm",
    "whisper": "speech-seq2seq",
    "bert": "encoder",
    "vit": "vision",
    "wav2vec2": "speech-encoder",
}


def test_architectures_are_read_from_transformers():
    rows = {m: (k, c) for m, k, c in coverage.architectures()}
    assert len(rows) > 200  # every auto mapping, not a registry of ours
    for model_type, kind in SUBSET.items():
        assert rows[model_type][0] == kind
    assert rows["whisper"][1] == "WhisperForConditionalGeneration"  # not WhisperForCausalLM


def test_subset_is_complete(tmp_path, capsys):
    assert (
        main(["coverage", "--out", str(tmp_path), "--only", ",".join(SUBSET), "--jobs", "2"]) == 0
    )
    data = json.loads((tmp_path / "coverage.json").read_text())
    rows = {r["model_type"]: r for r in data["rows"]}
    assert set(rows) == set(SUBSET)
    for row in rows.values():
        assert coverage.complete(row), row
        fused, total = row["attention"]
        assert fused == total > 0
    assert rows["whisper"]["main_input"] == "input_features"
    assert rows["vit"]["main_input"] == "pixel_values"
    assert all(rows[m]["tokens_equal"] for m, k in SUBSET.items() if k in coverage.DECODER_KINDS)
    assert data["summary"]["complete"] == data["summary"]["traced"] == len(SUBSET)
    text = (tmp_path / "COVERAGE.md").read_text()
    assert "complete (every attention layer fused" in text and "| gpt2 | causal-lm |" in text
    assert f"**{len(SUBSET)}** of {len(SUBSET)} traced (100%)" in text


def test_a_failure_is_a_row_and_a_rerun_resumes(tmp_path):
    row = coverage.run_one("gpt2", "causal-lm", "NoSuchModelClass")
    assert row["status"] == "not built" and "NoSuchModelClass" in row["reason"]
    assert not coverage.complete(row)
    path = tmp_path / "coverage.json"
    path.write_text(json.dumps({"rows": [row]}))
    data = coverage.run(tmp_path, only=["gpt2"])  # gpt2 has a row already: nothing reruns
    assert data["rows"] == [row]
    assert data["summary"]["by_status"] == {"not built": 1}
