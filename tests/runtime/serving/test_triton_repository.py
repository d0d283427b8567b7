"""``tfgraph triton``: the repository's configs, checked offline against Triton's ModelConfig
and the ONNX graphs; the plain (stateless) model of an uncached artifact; bad input."""

import json
import os

import pytest

import tfgraph
from tfgraph.cli import main
from tfgraph.errors import TfgraphError

pytest.importorskip("tritonclient.grpc", reason="needs tritonclient: pip install 'tfgraph[serve]'")

from tfgraph.runtime.serving.repository import (  # noqa: E402
    MARKER,
    check_config,
    parse_config,
    write_repository,
)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-artifacts")
    for preset, cached in [("llama-tiny", True), ("t5-tiny", True)]:
        assert tfgraph.export(preset, root / preset, kv_cache=cached).passed
    return root


def test_cached_decoder_keeps_its_cache_as_implicit_state(tmp_path, artifacts):
    repo = tmp_path / "repo"
    models = write_repository(artifacts / "llama-tiny", repo, name="llama")
    assert [(m.name, m.backend) for m in models] == [
        ("llama", "onnxruntime"),
        ("llama_generate", "python"),
    ]
    engine = parse_config(repo / "llama" / "config.pbtxt")
    states = engine.sequence_batching.state
    assert len(states) == 4  # 2 layers x key, value
    assert {s.input_name for s in states} == {
        f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value")
    }
    assert all(s.output_name.startswith("present.") for s in states)
    assert all(s.initial_state[0].zero_data for s in states)
    assert {i.name for i in engine.input} == {
        "input_ids",
        "past_sequence_length",
        "past_sequence_lengths",
    }
    assert [o.name for o in engine.output] == ["logits"]
    generate = parse_config(repo / "llama_generate" / "config.pbtxt")
    assert generate.backend == "python" and generate.model_transaction_policy.decoupled
    assert [o.name for o in generate.output] == ["token_id"]  # no tokenizer: no text
    assert (repo / "llama_generate" / "1" / "model.py").is_file()
    assert (repo / "llama_generate" / "1" / "artifact" / "manifest.json").is_file()
    written = json.loads((repo / MARKER).read_text())
    assert [m["name"] for m in written["models"]] == ["llama", "llama_generate"]


def test_encoder_decoder_gets_its_encoder_model(tmp_path, artifacts):
    repo = tmp_path / "repo"
    models = write_repository(artifacts / "t5-tiny", repo, name="t5")
    assert [m.name for m in models] == ["t5", "t5_encoder", "t5_generate"]
    encoder = parse_config(repo / "t5_encoder" / "config.pbtxt")
    assert not encoder.sequence_batching.state  # run once per prompt: stateless
    decoder = parse_config(repo / "t5" / "config.pbtxt")
    assert len(decoder.sequence_batching.state) > 0


def test_uncached_artifact_is_a_plain_batched_model(tmp_path, gpt_artifact, capsys):
    repo = tmp_path / "repo"
    assert main(["triton", str(gpt_artifact.out_dir), "-o", str(repo), "--name", "gpt"]) == 0
    assert "gpt" in capsys.readouterr().out
    assert sorted(p.name for p in repo.iterdir()) == ["gpt", MARKER]
    config = parse_config(repo / "gpt" / "config.pbtxt")
    assert config.max_batch_size == 8 and config.HasField("dynamic_batching")
    assert not config.HasField("sequence_batching")
    assert all(list(i.dims) and i.dims[0] == -1 for i in config.input)  # sequence stays -1
    # written again over its own repository: replaced
    assert main(["triton", str(gpt_artifact.out_dir), "-o", str(repo), "--name", "gpt"]) == 0


def test_a_name_mismatch_with_the_graph_is_caught(tmp_path, gpt_artifact):
    repo = tmp_path / "repo"
    write_repository(gpt_artifact.out_dir, repo, name="gpt")
    path = repo / "gpt" / "config.pbtxt"
    path.write_text(path.read_text().replace('"input_ids"', '"input_idz"'))
    with pytest.raises(TfgraphError, match="input_idz"):
        check_config(path, repo / "gpt")
    path.write_text(path.read_text().replace("max_batch_size", "max_batch_sise"))
    with pytest.raises(TfgraphError, match="not a valid Triton model config"):
        parse_config(path)


def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, gpt_artifact, capsys):
    not_artifact = tmp_path / "plain"
    not_artifact.mkdir()
    (not_artifact / "model.onnx").write_bytes(b"")
    out = tmp_path / "repo"
    cases = [
        ([str(not_artifact), "-o", str(out)], "is not a tfgraph artifact"),
        ([str(tmp_path / "missing"), "-o", str(out)], "is not a directory"),
    ]
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    cases.append(([str(gpt_artifact.out_dir), "-o", str(busy)], "is not a tfgraph Triton"))
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases.append(([str(gpt_artifact.out_dir), "-o", str(a_file / "repo")], "is not a directory"))
    cases.append(
        ([str(gpt_artifact.out_dir), "-o", "/proc/tfgraph-repo"], "cannot write the Triton")
    )
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases.append(([str(gpt_artifact.out_dir), "-o", str(locked / "repo")], "cannot write the"))
    for argv, needle in cases:
        assert main(["triton", *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]


def test_an_artifact_with_an_engine_gets_a_tensorrt_plan_model(tmp_path, artifacts):
    """No TensorRT here: a stand-in engine file named by the manifest; the config is checked
    offline against ModelConfig and the graph the engine comes from."""
    import shutil

    artifact = tmp_path / "with-engine"
    shutil.copytree(artifacts / "llama-tiny", artifact)
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["files"].append("model.plan")
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    (artifact / "model.plan").write_bytes(b"stand-in engine")
    models = write_repository(artifact, tmp_path / "repo", name="llama")
    assert [(m.name, m.backend) for m in models][1] == ("llama_trt", "tensorrt_plan")
    config = parse_config(tmp_path / "repo" / "llama_trt" / "config.pbtxt")
    assert config.platform == "tensorrt_plan" and not config.backend
    assert config.instance_group[0].kind == config.instance_group[0].KIND_GPU
    assert len(config.sequence_batching.state) == 4
    assert (tmp_path / "repo" / "llama_trt" / "1" / "model.plan").read_bytes() == b"stand-in engine"
