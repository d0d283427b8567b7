"""``python -m tfgraph quality DIR --text FILE``: the table, report.json's ``quality``, --json,
and one-line refusals of bad input (tfgraph/cli/quality.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.verify.test_quality import reference_artifact, short_text
from tfgraph.cli import main


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """A copy of a cacheless fp32 export of the reference model (this module rewrites its
    report). Cacheless: under pytest-xdist this file and tests/verify/test_quality.py run in
    different workers, so each exports its own; the cached one with its quality stage is
    tested there."""
    exported = reference_artifact(tmp_path_factory, "fp32-plain")
    copy = tmp_path_factory.mktemp("cli") / "artifact"
    shutil.copytree(exported, copy)
    return copy


def test_quality_prints_the_table_and_writes_the_report(artifact, tmp_path_factory, capsys):
    text = short_text(tmp_path_factory)
    argv = ["quality", str(artifact), "--text", str(text), "--max-tokens", "300"]
    assert main([*argv, "--window", "128"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"quality of {artifact} over {text}: 3 windows of 128 tokens")
    assert out[1].split()[:3] == ["PPL", "fp32", "PPL"]
    report = json.loads((artifact / "report.json").read_text())
    quality = report["quality"]
    assert (quality["tokens"], quality["window"], quality["windows"]) == (299, 128, 3)
    row = out[3].split()
    assert row[0] == f"{quality['ppl']:.4f}" and row[-1] == "299"
    assert report["parity"]["passed"]  # the rest of the report kept
    assert not list(artifact.glob(".report-*"))  # the temporary file renamed away

    assert main([*argv[:-1], "100", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["window"] == 512 and printed["tokens"] == 99
    assert json.loads((artifact / "report.json").read_text())["quality"] == printed


@pytest.mark.parametrize("case", ["missing", "empty", "no-artifact"])
def test_bad_input_exits_with_one_line(artifact, tmp_path, capsys, case):
    text = tmp_path / "text.txt"
    if case == "empty":
        text.write_text("")
    directory = tmp_path if case == "no-artifact" else artifact
    if case == "no-artifact":
        text.write_text("some words")
    assert main(["quality", str(directory), "--text", str(text)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert {"missing": "no text file", "empty": "at least 2", "no-artifact": "no report.json"}[
        case
    ] in lines[0]
