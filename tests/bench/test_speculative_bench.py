"""The speculative bench's pieces (bench/speculative.py, bench/speculative_peers.py): the copy
task repeats its snippet, decode tokens/s leaves out the prefill's token, a mode whose greedy
tokens differ from plain decoding fails the bench, llama.cpp's summary lines are read."""

from __future__ import annotations

import pytest

from tfgraph.bench import speculative, speculative_peers


def _run(tokens, seconds, acceptance=0.5, per_step=2.0):
    return {"tokens": tokens, "seconds": seconds, "acceptance": acceptance,
            "tokens_per_step": per_step}  # fmt: skip


def test_the_copy_prompts_end_with_their_snippets_head():
    pytest.importorskip("transformers")
    got = speculative.prompts(speculative.MODEL, 2)
    assert len(got["heldout"]) == len(got["copy"]) == 2
    assert all(len(p) == speculative.PROMPT_TOKENS for p in got["heldout"])
    for prompt in got["copy"]:
        head = prompt[: speculative.COPY_HEAD]
        assert prompt[-speculative.COPY_HEAD :] == head
        assert len(prompt) == 2 * speculative.SNIPPET + speculative.COPY_HEAD
        n = speculative.SNIPPET
        assert prompt[:n] == prompt[n : 2 * n]


def test_tokens_per_second_counts_the_tokens_after_the_first():
    assert speculative.tokens_per_second(_run([[1, 2, 3], [4, 5]], [1.0, 2.0])) == 1.0


def test_summary_ratios_within_rounds_and_refuses_other_tokens():
    plain = [_run([[1, 2, 3]], [2.0]), _run([[1, 2, 3]], [4.0])]
    fast = [_run([[1, 2, 3]], [1.0]), _run([[1, 2, 3]], [1.0])]
    table = {"plain": {"runs": plain}, "lookup k=4": {"runs": fast}}
    rows = {r["mode"]: r for r in speculative.summarize(table, "fp32", "copy")}
    assert rows["lookup k=4"]["speedup"] == pytest.approx(3.0)  # median of 2× and 4×
    assert rows["plain"]["speedup"] == 1.0
    table["lookup k=4"]["runs"][1] = _run([[1, 2, 4]], [1.0])
    with pytest.raises(AssertionError, match="greedy tokens differ"):
        speculative.summarize(table, "fp32", "copy")


def test_llama_cpp_summary_lines_are_read(tmp_path, monkeypatch):
    out = "I decoded   66 tokens in   2.500 seconds, speed: 26.4 t/s\nI accept    = 62.500%\n"

    class Done:
        returncode, stdout, stderr = 0, out, ""

    monkeypatch.setattr(speculative_peers.subprocess, "run", lambda *a, **k: Done())
    got = speculative_peers.run_one(tmp_path, ["llama-lookup"], "text", 64)
    assert got == {"tokens": 66, "seconds": 2.5, "acceptance": 0.625}
    Done.stdout = "error: unknown argument --spec-type\n"
    assert "unknown argument" in speculative_peers.run_one(tmp_path, ["x"], "t", 4)["error"]


def test_the_report_renders_the_section(tmp_path):
    import json

    from tfgraph.bench import report

    row = {"engine": "tfgraph", "precision": "fp32", "task": "copy", "mode": "lookup k=4",
           "tokens_per_s": 40.0, "speedup": 1.61, "acceptance": 0.5,
           "tokens_per_step": 2.5}  # fmt: skip
    peer = {**row, "engine": "llama.cpp", "tokens_per_step": None, "speedup": None}
    (tmp_path / "bench").mkdir()
    data = {"rows": [row], "peers": [peer]}
    (tmp_path / "bench" / "speculative.json").write_text(json.dumps(data))
    text = report.render(tmp_path).read_text()
    assert "## Speculative decoding" in text
    assert "| tfgraph | fp32 | copy | lookup k=4 | 40.0 | 1.61 | 50% | 2.50 |" in text
    assert "| llama.cpp | fp32 | copy | lookup k=4 | 40.0 | — | 50% | — |" in text
