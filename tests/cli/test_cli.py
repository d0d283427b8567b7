"""The CLI through main(argv), as a user meets it."""

import json

import pytest

from tfgraph.cli import main


def _one_line_error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


def test_models_lists_presets(capsys):
    from tfgraph.models import PRESETS

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in PRESETS:
        assert name in out
    header = out.splitlines()[0].split()
    assert header[:6] == ["preset", "family", "attention", "positions", "norm", "ffn"]


def test_export_run_inspect(tmp_path, capsys):
    out = tmp_path / "art"
    assert main(["export", "gpt-tiny", "-o", str(out), "--check-each-pass", "-v"]) == 0
    printed = capsys.readouterr()
    assert "parity vs eager PyTorch" in printed.out and "pass" in printed.out
    assert "IdentityEliminationPass" in printed.out  # -v: per-pass table
    assert "[5/5] parity" in printed.err  # progress
    report = json.loads((out / "report.json").read_text())
    assert report["parity"]["passed"]

    assert main(["run", str(out), "--input-ids", "1 2 3"]) == 0
    run_out = capsys.readouterr().out
    assert "(1, 3, 256)" in run_out and "next token" in run_out

    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    norm = report["fusions"]["norm"]
    assert "com.microsoft::GroupQueryAttention  2" in text and "Softmax" not in text
    assert "attention  2/2" in text and f"norm       {norm['fused']}/5" in text
    assert "fused attention in decoder.blocks.1.attn: GroupQueryAttention" in text
    for layer in report["fusions"]["norm"]["fused_layers"]:  # folded norms, per layer
        assert f"fused norm in {layer['module']}: {layer['op']}" in text
    assert norm["fused"] == 5 and "fused norm in decoder.blocks.0.ln_1" in text

    assert main(["inspect", str(out / "model.onnx")]) == 0
    assert "input_ids" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        ("no-such-preset", "unknown model 'no-such-preset'"),
        ("no_such_pkg.mod:make", "cannot import 'no_such_pkg.mod'"),
        ("factories:missing_fn", "has no callable 'missing_fn'"),
        ("factories:not_a_module", "returned int"),
    ],
)
def test_bad_model_argument(tmp_path, capsys, model, needle):
    out = tmp_path / "out"
    assert main(["export", model, "-o", str(out)]) == 2
    assert needle in _one_line_error(capsys)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no staging directory left either


def test_directory_without_model(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    assert main(["export", str(empty), "-o", str(out)]) == 2
    assert "holds no model" in _one_line_error(capsys)
    assert not out.exists()


def test_run_errors(gpt_artifact, tmp_path, capsys):
    assert main(["run", str(tmp_path), "--input-ids", "1 2"]) == 2
    assert "no ONNX model" in _one_line_error(capsys)
    assert main(["run", str(gpt_artifact.out_dir), "--input-ids", "1 x"]) == 2
    assert "--input-ids must be integers" in _one_line_error(capsys)
    assert main(["run", str(gpt_artifact.out_dir), "--input-ids", "1", "--provider", "tpu"]) == 2
    assert "unknown provider 'tpu'" in _one_line_error(capsys)


def test_parity_failure_exits_1_and_keeps_report(tmp_path, capsys):
    out = tmp_path / "strict"
    code = main(
        [
            "export",
            "factories:tiny_lm",
            "-o",
            str(out),
            "--atol",
            "0",
            "--rtol",
            "0",
            "--pipeline",
            "cleanup",
            "--dump-after",
            "TopologicalSortPass",
        ]
    )
    report = json.loads((out / "report.json").read_text())
    worst = report["parity"]["outputs"][0]["max_abs_err"]
    if worst == 0.0:
        pytest.fail("ORT reproduced eager bit for bit: the zero tolerance cannot fail here")
    assert code == 1
    assert report["parity"]["passed"] is False
    assert "parity failed" in _one_line_error(capsys)
    assert (out / "after_TopologicalSortPass.onnx").is_file()


def test_usage_error_exit_code(capsys):
    assert main(["export"]) == 2
    assert main(["--version"]) == 0


def test_readme_preset_table_is_current():
    from pathlib import Path

    from tfgraph.cli import models_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert models_table(markdown=True) in readme, "regenerate: python -m tfgraph models --markdown"


def test_weights_line_says_a_checkpoint_kept_its_own_integers(capsys):
    """An AWQ/GPTQ checkpoint's int4 export names its shipped weights and the block size it
    took, not just the export's --block-size and symmetry."""
    from tfgraph.cli.output import print_weights

    weights = {
        "weights": "int4",
        "block_size": 32,
        "symmetric": True,
        "accuracy_level": 4,
        "weight_bytes_before": 1 << 20,
        "weight_bytes_after": 1 << 18,
        "quantized": [{"module": "m"}] * 15,
        "unquantized": [],
        "source_format": "awq checkpoint",
        "shipped_weights": 14,
        "block_size_note": "the checkpoint's group size: --block-size 128 overridden",
    }
    print_weights(weights, verbose=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (
        "  14 weights as the awq checkpoint ships them (its zero points; the checkpoint's group "
        "size: --block-size 128 overridden); the rest as above"
    )
    del weights["source_format"]
    print_weights(weights, verbose=False)
    assert len(capsys.readouterr().out.splitlines()) == 1
