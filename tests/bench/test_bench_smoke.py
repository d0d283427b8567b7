"""``python -m tfgraph bench --quick`` runs end to end and writes what it promises: one JSON
file per section, the PNG plots, and a BENCHMARKS.md with the machine, the command and a table
per section. No timing assertions: speed is shown by the benchmark itself, not by tests.

The bench runs once for the module (the ``bench`` fixture: a fresh process, as a user runs it,
a few minutes on 2 cores); each test then checks one part of its output."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tfgraph.cli import main

# slow, the whole module: the quick bench end to end (python -m tfgraph bench --quick, about 2
# minutes); the bench sections' own tests stay in the default tier
pytestmark = pytest.mark.slow

pytest.importorskip("matplotlib")
pytest.importorskip("transformers")

SECTIONS = {
    "prefill",
    "attention_memory",
    "decode",
    "compile_cost",
    "peers",
    "exporters",
    "precision",
    "serving",
    "scale",
    "norm_folding",
    "quality",
    "decode_peers",
    "speculative",
    "scale_out",
}
TITLES = (
    "## Prefill",
    "## Attention fusion",
    "## Decode",
    "## Compile cost",
    "## Peers",
    "## Exporters",
    "## Precision",
    "## Serving",
    "## Scale",
)


@dataclass
class Run:
    out: Path
    returncode: int
    stdout: str
    stderr: str

    def json(self, file: str) -> dict:
        return json.loads((self.out / "bench" / f"{file}.json").read_text())


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Run:
    out = tmp_path_factory.mktemp("bench") / "bench-out"
    done = subprocess.run(
        [sys.executable, "-m", "tfgraph", "bench", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    return Run(out, done.returncode, done.stdout, done.stderr)


@pytest.fixture(scope="module")
def suite(bench: Run) -> dict:
    assert bench.returncode == 0, bench.stderr[-3000:]
    return bench.json("suite")


def test_every_section_runs_and_is_timed(bench: Run, suite: dict):
    assert suite["quick"] is True and suite["machine"]["threads"] == 2
    sections = suite["sections"]
    assert set(sections) == SECTIONS
    assert not [n for n, s in sections.items() if "error" in s], sections
    assert sections["norm_folding"]["skipped"]  # full runs only
    for name, info in sections.items():
        assert info["seconds"] >= 0 and info["cpu_seconds"] >= 0, (name, info)
        assert f"{name} done: " in bench.stderr  # each section's wall and CPU time, as it ends
    assert suite["seconds"] > 0 and suite["cpu_seconds"] > 0
    assert "all sections: " in bench.stderr
    names = ("prefill", "attention_prefill", "decode", "compile_cost", "peers", "exporters")
    for name in (*names, "precision", "serving"):
        data = bench.json(name)
        assert "error" not in data and "skipped" not in data, name
    assert "section" in bench.stdout and "BENCHMARKS.md" in bench.stdout


def test_quick_run_shares_traces_and_exports(suite: dict):
    """peers' two exports are prefill's; each model is traced once per opset."""
    shared = suite["shared"]
    assert shared["exports_reused"] >= 2, shared
    assert shared["traces_reused"] >= 10, shared  # prefill 4, attention_memory 1, precision 5
    assert suite["env"]["set"].get("OMP_WAIT_POLICY", "PASSIVE") == "PASSIVE"


def test_prefill(bench: Run):
    prefill = bench.json("prefill")
    assert set(prefill["models"]) == {"gpt-tiny", "bert-tiny"} and len(prefill["seqs"]) == 2
    for label, model in prefill["models"].items():
        assert all(model["parity_passed"].values()), (label, model["parity_passed"])
        for config, by_seq in model["configs"].items():
            for seq in map(str, prefill["seqs"]):
                assert by_seq[seq]["seconds"] > 0, (label, config, seq, by_seq[seq])


def test_attention_and_peers(bench: Run):
    attention = bench.json("attention_prefill")
    assert attention["default_attention"]["fused"] == attention["default_attention"]["total"] > 0
    assert attention["cleanup_attention"]["fused"] == 0
    peers = bench.json("peers")["peers"]
    assert peers["tfgraph"]["available"] and peers["tfgraph"]["fused_attention"] > 0
    assert peers["unfused"]["fused_attention"] == 0
    assert peers["tfgraph"]["max_abs_err_vs_eager"] < 1e-3


def test_decode_and_compile_cost(bench: Run):
    decode = bench.json("decode")["tiny"]
    assert decode["same_tokens_as_hf_generate"] and decode["same_tokens_as_eager"]
    assert all(v > 0 for v in decode["tokens_per_s"].values())
    assert set(decode["step_seconds"]) == {"past_128", "past_1016"}
    compile_cost = bench.json("compile_cost")
    assert len(compile_cost["rows"]) >= 2
    assert all(row["parity_passed"] and row["trace_s"] > 0 for row in compile_cost["rows"])
    assert compile_cost["per_doubling"]["total_overall"] > 0


def test_exporters(bench: Run):
    exporters = bench.json("exporters")["models"]["llama"]
    tfgraph_row = exporters["peers"]["tfgraph"]
    assert tfgraph_row["available"] and "error" not in tfgraph_row, tfgraph_row
    assert set(tfgraph_row["step_seconds"]) == {"128", "512", "1016"}
    assert tfgraph_row["nodes"] > 0 and tfgraph_row["prefill_seconds"] > 0
    for peer in ("tfgraph_static", "transformers", "genai_builder"):  # measured, or why not
        entry = exporters["peers"][peer]
        assert ("error" not in entry and entry["step_seconds"]) or entry.get("note"), entry


def test_precision(bench: Run):
    variants = bench.json("precision")["models"]["llama-tiny"]["variants"]
    assert set(variants) == {"fp32", "int8", "int4", "int4-level0", "fp16"}
    assert all("error" not in e and e["tokens_per_s"] > 0 for e in variants.values()), variants
    assert variants["int4"]["weight_bytes"] < variants["fp32"]["weight_bytes"] / 2.5


def test_serving(bench: Run, suite: dict):
    serving = bench.json("serving")["models"]["gpt2-tiny"]
    assert set(serving["batching"]) == {"static", "inflight", "inflight_int8"}
    for mode in serving["batching"].values():
        runs = mode["served"]
        assert [r["concurrency"] for r in runs] == [1, 4]
        assert all(r["tokens_per_s"] > 0 and r["requests"] >= 1 for r in runs)
    kv = serving["kv_bytes_per_slot"]
    assert kv["int8"] * 4 == kv["fp32"]
    assert all(t["fp32"] > 0 and t["int8"] > 0 for b, t in serving["decode_step"].items()
               if b != "past")  # fmt: skip
    assert serving["local"]["tokens_per_s"] > 0 and "serving.png" in suite["plots"]


def test_scale(bench: Run, suite: dict):
    """The quick run's scale section: the ~120M checkpoint through every exporter."""
    row = bench.json("scale")["models"]["llama-120m"]
    assert 1.0e8 < row["parameters"] < 1.5e8
    for peer in ("tfgraph fp32", "tfgraph int4", "builder fp32", "builder int4"):
        entry = row[peer]
        assert entry["exit"] == 0 and "killed" not in entry, (peer, entry)
        assert entry["wall_s"] > 0 and entry["peak_rss_gib"] > 0.1, (peer, entry)
        assert entry["decode_step_ms"] > 0 and entry["session_rss_gib"] > 0, (peer, entry)
    assert row["tfgraph int4"]["artifact_gib"] < 0.5 * row["tfgraph fp32"]["artifact_gib"]
    assert "scale.png" in suite["plots"]


def test_plots_and_markdown(bench: Run, suite: dict):
    for png in suite["plots"]:
        assert (bench.out / "bench" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"prefill_latency.png", "prefill_memory.png", "decode.png", "compile_cost.png"} <= set(
        suite["plots"]
    )
    markdown = (bench.out / "BENCHMARKS.md").read_text()
    assert "python -m tfgraph bench --quick" in markdown
    assert "| section | time | CPU | status |" in markdown
    for title in TITLES:
        assert title in markdown


def test_bench_unknown_section_is_a_clear_error(tmp_path, capsys):
    assert main(["bench", "--only", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown section" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
