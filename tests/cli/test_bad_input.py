"""Bad input, case by case: one `error:` line naming the problem and what to do, exit code 2,
and never a half-written artifact (see the README's exit codes)."""

import errno
import json
import os
import shutil

import numpy as np
import onnx_ir
import pytest

import tfgraph
from tfgraph import ARTIFACT_FORMAT, TfgraphError
from tfgraph.cli import main
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, generate

COMMANDS = {  # each artifact-reading command, with the arguments it needs besides the path
    "run": ["--input-ids", "1 2 3"],
    "inspect": [],
    "generate": ["--input-ids", "1 2 3", "--max-new-tokens", "2"],
}


def _one_line_error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


def _command(name: str, path) -> list[str]:
    return [name, str(path), *COMMANDS[name]]


@pytest.fixture(scope="module")
def cached_gpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("cached") / "gpt-tiny"
    assert tfgraph.export("gpt-tiny", out, kv_cache=True).passed
    return out


@pytest.fixture(scope="module")
def cnn_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("cnn") / "cnn"
    assert tfgraph.export("bad_models:small_cnn", out).passed
    return out


@pytest.mark.parametrize("command", list(COMMANDS))
def test_missing_model_file(tmp_path, capsys, command):
    assert main(_command(command, tmp_path / "nowhere")) == 2
    assert "no ONNX model at" in _one_line_error(capsys)
    assert main(_command(command, tmp_path / "nowhere.onnx")) == 2
    assert "no ONNX model at" in _one_line_error(capsys)


GARBAGE = b"this is not an ONNX model\n" * 200


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_corrupt_model_file(cached_gpt, tmp_path, capsys, command, damage):
    art = tmp_path / "art"
    shutil.copytree(cached_gpt, art)
    model = art / "model.onnx"
    data = model.read_bytes()
    model.write_bytes(data[: len(data) // 2] if damage == "truncated" else GARBAGE)
    assert main(_command(command, art)) == 2
    line = _one_line_error(capsys)
    assert "cannot" in line and "model.onnx" in line, line


@pytest.mark.parametrize("factory", ["small_cnn", "image_cnn"])
def test_not_a_transformer_exports_with_nothing_fused(tmp_path, capsys, factory):
    out = tmp_path / "cnn"
    assert main(["export", f"bad_models:{factory}", "-o", str(out)]) == 0
    printed = capsys.readouterr()
    assert "error:" not in printed.err
    assert "no attention, norm or GELU candidates found" in printed.out
    report = json.loads((out / "report.json").read_text())
    assert report["parity"]["passed"]
    for kind in ("attention", "norm", "gelu"):
        assert report["fusions"][kind]["total"] == report["fusions"][kind]["fused"] == 0
        assert report["fusions"][kind]["missed"] == []
    assert main(["inspect", str(out)]) == 0
    assert "no attention, norm or GELU candidates found" in capsys.readouterr().out


def test_data_dependent_control_flow(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", "bad_models:branchy", "-o", str(out)]) == 2
    line = _one_line_error(capsys)
    assert "data-dependent" in line, line
    assert "if x.sum() > 0" in line, line  # the source line of the construct
    assert list(tmp_path.iterdir()) == []  # nothing written, no staging directory


WANTS = "the model wants"


@pytest.mark.parametrize(
    ("inputs", "needle"),
    [
        ({"ids": np.zeros((1, 3), np.int64)}, r"missing \['input_ids'\], unknown \['ids'\]"),
        ({"input_ids": np.zeros((1, 3), np.float32)}, f"dtype float32, {WANTS} int64"),
        ({"input_ids": np.zeros(3, np.int64)}, rf"shape \(3,\), {WANTS} \(batch, sequence\)"),
        ({"x": np.zeros((1, 5, 3), np.float32)}, rf"\(1, 5, 3\), {WANTS} \(batch, sequence, 4\)"),
    ],
    ids=["name", "dtype", "rank", "static-dim"],
)
def test_wrong_inputs(gpt_artifact, cnn_artifact, inputs, needle):
    session = Session(cnn_artifact if "x" in inputs else gpt_artifact.out_dir)
    with pytest.raises(TfgraphError, match=needle):
        session.run(inputs)


def test_run_cannot_fill_a_float_input(cnn_artifact, capsys):
    assert main(["run", str(cnn_artifact), "--input-ids", "1 2 3"]) == 2
    assert "takes input 'x', which `run` cannot fill" in _one_line_error(capsys)


def test_positions_beyond_the_model(gpt_artifact, cached_gpt, capsys, monkeypatch):
    manifest = json.loads((cached_gpt / "manifest.json").read_text())
    assert manifest["max_positions"] == 128  # gpt-tiny: a learned table of 128 positions
    ids = " ".join(["1"] * 100)
    assert main(["generate", str(cached_gpt), "--input-ids", ids, "--max-new-tokens", "40"]) == 2
    line = _one_line_error(capsys)
    assert "needs 139 positions but the model supports 128" in line, line
    assert main(["run", str(gpt_artifact.out_dir), "--input-ids", " ".join(["1"] * 129)]) == 2
    assert "129 positions (sequence), more than the 128" in _one_line_error(capsys)

    decoder = CachedDecoder(Session(cached_gpt))

    def never(*args, **kwargs):
        raise AssertionError("ONNX Runtime ran")

    monkeypatch.setattr(decoder.session.ort_session, "run_with_iobinding", never)
    with pytest.raises(TfgraphError, match="supports 128"):
        generate(decoder, [[1] * 120], GenerationConfig(max_new_tokens=10))
    cache = decoder.empty_cache(1, 200)
    cache.length = 127
    with pytest.raises(TfgraphError, match="past 127 \\+ 2 new tokens needs 129 positions"):
        decoder.step(np.ones((1, 2), np.int64), cache)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_artifact_from_a_newer_tfgraph(cached_gpt, tmp_path, capsys, command):
    art = tmp_path / "art"
    shutil.copytree(cached_gpt, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["format"] = ARTIFACT_FORMAT + 1
    (art / "manifest.json").write_text(json.dumps(manifest))
    assert main(_command(command, art)) == 2
    want = f"written by a newer tfgraph (format {ARTIFACT_FORMAT + 1} > {ARTIFACT_FORMAT})"
    line = _one_line_error(capsys)
    assert want in line and "upgrade tfgraph" in line, line
    with pytest.raises(TfgraphError, match="upgrade tfgraph"):
        Session(art)


def _export_cli(out) -> int:
    return main(["export", "factories:tiny_lm", "-o", str(out), "--pipeline", "cleanup"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permissions (see the simulated test)")
def test_output_directory_not_writable(tmp_path, capsys):
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        assert _export_cli(parent / "art") == 2
        assert "permission denied" in _one_line_error(capsys)
        assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o755)


def _failing_save(error: int):
    """A save that writes half a file, then fails as the system would."""

    def save(model, path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\0" * 1024)
        raise OSError(error, os.strerror(error), str(path))

    return save


def test_output_directory_not_writable_simulated(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(onnx_ir, "save", _failing_save(errno.EACCES))
    assert _export_cli(tmp_path / "out" / "art") == 2
    line = _one_line_error(capsys)
    assert "cannot write the artifact" in line and "Permission denied" in line, line
    assert "choose an output directory you can write" in line
    assert list(tmp_path.iterdir()) == []  # no staging directory, no created parents


def test_disk_full(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(onnx_ir, "save", _failing_save(errno.ENOSPC))
    assert _export_cli(tmp_path / "art") == 2
    line = _one_line_error(capsys)
    assert "No space left on device" in line and "free some disk space" in line, line
    assert list(tmp_path.iterdir()) == []
