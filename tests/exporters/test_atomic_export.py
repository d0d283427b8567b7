"""A failure at any step of export leaves no artifact and no staging directory behind."""

import pytest

import tfgraph
import tfgraph.exporters.write as write_mod
import tfgraph.exporting as export_mod
import tfgraph.verify.artifact as verify_mod
from tfgraph import TfgraphError


class Boom(RuntimeError):
    pass


def _fail(*args, **kwargs):
    raise Boom("injected failure")


@pytest.mark.parametrize(
    "module, target",
    [(verify_mod, "check_parity"), (export_mod, "write_json"), (write_mod, "save_onnx")],
)
def test_failure_mid_export_leaves_nothing(tmp_path, monkeypatch, module, target):
    monkeypatch.setattr(module, target, _fail)
    out = tmp_path / "art"
    with pytest.raises(Boom):
        tfgraph.export("factories:tiny_lm", out)
    assert list(tmp_path.iterdir()) == []


def test_failure_keeps_previous_artifact(tmp_path, monkeypatch):
    out = tmp_path / "art"
    tfgraph.export("factories:tiny_lm", out)
    before = (out / "model.onnx").read_bytes()
    monkeypatch.setattr(export_mod, "write_json", _fail)
    with pytest.raises(Boom):
        tfgraph.export("factories:tiny_lm_with_inputs", out)
    assert (out / "model.onnx").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_refuses_foreign_directory(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(TfgraphError, match="not a tfgraph artifact"):
        tfgraph.export("factories:tiny_lm", out)
    assert (out / "notes.txt").read_text() == "keep me"


def test_missing_parents_are_created_and_removed_on_failure(tmp_path, monkeypatch):
    out = tmp_path / "a" / "b" / "art"
    tfgraph.export("factories:tiny_lm", out)
    assert (out / "model.onnx").is_file()
    monkeypatch.setattr(verify_mod, "check_parity", _fail)
    with pytest.raises(Boom):
        tfgraph.export("factories:tiny_lm", tmp_path / "x" / "y" / "art")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_output_under_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(TfgraphError, match="is not a directory"):
        tfgraph.export("factories:tiny_lm", tmp_path / "f" / "art")
