"""``python -m tfgraph bench --quick`` runs end to end and writes what it promises: one JSON
file per section, the PNG plots, and a BENCHMARKS.md with the machine, the command and a table
per section. No timing assertions: speed is shown by the benchmark itself, not by tests."""

import json

import pytest

from tfgraph.cli import main

pytest.importorskip("matplotlib")
pytest.importorskip("transformers")


def test_bench_quick_writes_json_plots_and_markdown(tmp_path, capsys):
    out = tmp_path / "bench-out"
    code = main(["bench", "--quick", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    suite = json.loads((out / "bench" / "suite.json").read_text())
    assert suite["quick"] is True and suite["machine"]["threads"] == 2
    sections = suite["sections"]
    assert set(sections) == {
        "prefill",
        "attention_memory",
        "decode",
        "compile_cost",
        "peers",
        "exporters",
        "precision",
        "serving",
        "norm_folding",
    }
    assert not [n for n, s in sections.items() if "error" in s], sections
    assert sections["norm_folding"]["skipped"]  # full runs only
    names = ("prefill", "attention_prefill", "decode", "compile_cost", "peers", "exporters")
    for name in (*names, "precision"):
        data = json.loads((out / "bench" / f"{name}.json").read_text())
        assert "error" not in data and "skipped" not in data, name
    decode = json.loads((out / "bench" / "decode.json").read_text())["tiny"]
    assert decode["same_tokens_as_hf_generate"] and decode["same_tokens_as_eager"]
    assert all(v > 0 for v in decode["tokens_per_s"].values())
    for png in suite["plots"]:
        assert (out / "bench" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"prefill_latency.png", "prefill_memory.png", "decode.png", "compile_cost.png"} <= set(
        suite["plots"]
    )
    precision = json.loads((out / "bench" / "precision.json").read_text())["models"]
    variants = precision["llama-tiny"]["variants"]
    assert set(variants) == {"fp32", "int8", "int4", "int4-level0", "fp16"}
    assert all("error" not in e and e["tokens_per_s"] > 0 for e in variants.values()), variants
    assert variants["int4"]["weight_bytes"] < variants["fp32"]["weight_bytes"] / 2.5
    serving = json.loads((out / "bench" / "serving.json").read_text())["models"]["gpt2-tiny"]
    assert [r["concurrency"] for r in serving["served"]] == [1, 4]
    assert all(r["tokens_per_s"] > 0 and r["requests"] >= 1 for r in serving["served"])
    assert serving["local"]["tokens_per_s"] > 0 and "serving.png" in suite["plots"]
    exporters = json.loads((out / "bench" / "exporters.json").read_text())["models"]["llama"]
    tfgraph_row = exporters["peers"]["tfgraph"]
    assert tfgraph_row["available"] and "error" not in tfgraph_row, tfgraph_row
    assert set(tfgraph_row["step_seconds"]) == {"128", "512", "1016"}
    assert tfgraph_row["nodes"] > 0 and tfgraph_row["prefill_seconds"] > 0
    for peer in ("transformers", "genai_builder"):  # measured, or the reason it was not
        entry = exporters["peers"][peer]
        assert ("error" not in entry and entry["step_seconds"]) or entry.get("note"), entry
    markdown = (out / "BENCHMARKS.md").read_text()
    assert "python -m tfgraph bench --quick" in markdown
    for title in (
        "## Prefill",
        "## Attention fusion",
        "## Decode",
        "## Compile cost",
        "## Peers",
        "## Exporters",
        "## Precision",
        "## Serving",
    ):
        assert title in markdown
    assert "section" in printed.out and "BENCHMARKS.md" in printed.out


def test_bench_unknown_section_is_a_clear_error(tmp_path, capsys):
    assert main(["bench", "--only", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown section" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
