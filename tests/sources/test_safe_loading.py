"""Loading is safe: external data never comes from outside the model directory, checkpoints load
without running pickled code, and a model directory's own code runs only when trusted."""

import json
import shutil
from pathlib import Path

import onnx
import pytest

import tfgraph
from tfgraph import TfgraphError
from tfgraph.cli import main
from tfgraph.runtime import Session

ENTRY_POINTS = ("run", "inspect", "generate", "Session")


def _one_line_error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


@pytest.fixture(scope="module")
def external_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("ext") / "art"
    result = tfgraph.export("factories:tiny_lm", out, external_data=True, pipeline="cleanup")
    assert result.manifest["files"] == ["model.onnx", "model.onnx.data"]
    return out


def _relocate(model_file: Path, location: str) -> None:
    """Point every external tensor of ``model_file`` at ``location``."""
    proto = onnx.load(str(model_file), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(proto, str(model_file))


def _escape(kind: str, art: Path, outside: Path) -> str:
    """Move the weights out of ``art`` and return a location that reaches them from there."""
    data = outside / "stolen.data"
    shutil.move(art / "model.onnx.data", data)
    if kind == "dotdot":
        return f"../{outside.name}/stolen.data"
    if kind == "absolute":
        return str(data)
    (art / "link.data").symlink_to(data)  # a name inside that leads outside
    return "link.data"


def _open(entry: str, art: Path, capsys) -> str:
    if entry == "Session":
        with pytest.raises(TfgraphError) as info:
            Session(art)
        return str(info.value)
    args = {"run": ["--input-ids", "1 2"], "inspect": [], "generate": ["--input-ids", "1"]}
    assert main([entry, str(art), *args[entry]]) == 2
    return _one_line_error(capsys)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_external_data_outside_the_directory_is_refused(
    external_artifact, tmp_path, capsys, kind, entry
):
    art, outside = tmp_path / "art", tmp_path / "outside"
    shutil.copytree(external_artifact, art)
    outside.mkdir()
    location = _escape(kind, art, outside)
    _relocate(art / "model.onnx", location)
    message = _open(entry, art, capsys)
    assert f"the external data '{location}'" in message, message
    assert "external data must be a file beside the model" in message


def test_external_data_inside_the_directory_loads(external_artifact, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(external_artifact, art)
    (art / "weights").mkdir()
    shutil.move(art / "model.onnx.data", art / "weights" / "w.data")
    _relocate(art / "model.onnx", "weights/w.data")
    assert Session(art).run({"tokens": [[1, 2, 3]]})["logits"].shape == (1, 3, 50)


def _evil_checkpoint(directory: Path, marker: Path) -> None:
    """A pytorch_model.bin whose unpickling would create ``marker`` (a harmless stand-in for
    running any code)."""
    import torch

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"transformer.wte.weight": Payload()}, directory / "pytorch_model.bin")


def _gpt2_dir(path: Path, *, safetensors: bool) -> Path:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    if safetensors:
        model.save_pretrained(path)
    else:
        config.save_pretrained(path)
    return path


def test_pickled_code_in_a_checkpoint_is_refused(tmp_path, capsys):
    model_dir = _gpt2_dir(tmp_path / "hf", safetensors=False)
    marker = tmp_path / "pwned"
    _evil_checkpoint(model_dir, marker)
    out = tmp_path / "out"
    assert main(["export", str(model_dir), "-o", str(out)]) == 2
    line = _one_line_error(capsys)
    assert "cannot load the model" in line and "plain-tensor pytorch_model.bin" in line, line
    assert not marker.exists(), "the pickle ran"
    assert not out.exists()


def test_safetensors_are_preferred_over_a_pickle(tmp_path):
    model_dir = _gpt2_dir(tmp_path / "hf", safetensors=True)
    marker = tmp_path / "pwned"
    _evil_checkpoint(model_dir, marker)  # beside model.safetensors: never read
    source = tfgraph.load_source(str(model_dir))
    assert source.info["max_positions"] == 32  # n_positions of the config
    assert not marker.exists()


def test_remote_code_runs_only_when_trusted(tmp_path, capsys):
    model_dir = tmp_path / "custom"
    model_dir.mkdir()
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').close()\n"
    for name in ("configuration_evil.py", "modeling_evil.py"):
        (model_dir / name).write_text(code)
    config = {
        "model_type": "evil",
        "architectures": ["EvilModel"],
        "auto_map": {
            "AutoConfig": "configuration_evil.EvilConfig",
            "AutoModel": "modeling_evil.EvilModel",
        },
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "model.safetensors").write_bytes(b"")
    out = tmp_path / "out"
    assert main(["export", str(model_dir), "-o", str(out)]) == 2
    line = _one_line_error(capsys)
    assert "auto_map" in line and "--trust-remote-code" in line, line
    assert not marker.exists(), "the directory's code ran"
    assert not out.exists()


def test_tokenizer_code_in_an_artifact_never_runs(tmp_path):
    pytest.importorskip("transformers")
    from tfgraph.runtime.tokenizer import load_tokenizer

    tokenizer = tmp_path / "art" / "tokenizer"
    tokenizer.mkdir(parents=True)
    marker = tmp_path / "ran"
    (tokenizer / "tokenization_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = {
        "tokenizer_class": "EvilTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]},
    }
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TfgraphError, match="cannot load the tokenizer"):
        load_tokenizer(str(tmp_path / "art"))
    assert not marker.exists(), "the tokenizer's code ran"
