"""Bad input gets one line and exit 2, never a traceback: token ids outside the vocabulary,
an opset the exporter cannot write; a model with few positions is checked inside its limit."""

from __future__ import annotations

import idiom_models

import tfgraph
from tfgraph.cli import main
from tfgraph.sources import from_module


def _error_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    return [line for line in err.splitlines() if line.strip() and not line.startswith("[")]


def test_token_id_beyond_the_vocabulary_is_one_line(gpt_artifact, capsys):
    assert main(["run", str(gpt_artifact.out_dir), "--input-ids", "1 2 999"]) == 2
    lines = _error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: ONNX Runtime could not run")
    assert "idx=999" in lines[0] and "token ids must be below the vocabulary size" in lines[0]


def test_unsupported_opset_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "op17"
    assert main(["export", "gpt-tiny", "-o", str(out), "--opset", "17"]) == 2
    lines = _error_lines(capsys)
    assert lines == [lines[0]] and "--opset 17 is not supported: choose 18 to" in lines[0]
    assert not out.exists()


def test_parity_shapes_stay_inside_the_models_positions(tmp_path):
    source = from_module(idiom_models.short_gpt(), origin="idiom:short_gpt")
    assert source.info["max_positions"] == 16
    result = tfgraph.export(source, tmp_path / "short", kv_cache=True)
    parity = result.report["parity"]
    assert parity["shapes"] == [[1, 7], [2, 16]]
    assert result.passed and parity["prefill"]["passed"] and parity["decode"]["passed"]
