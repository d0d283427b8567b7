"""``tfgraph triton`` prints a start command that works after the documented install
(``tfgraph tritonserver REPO``: the server environment's ``tritonserver`` with the environment,
backends directory and stub it needs), and a missing client extra or server environment is
one ``error:`` line."""

import importlib.abc
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from child_signals import terminal_signals

import tfgraph
import tfgraph.runtime.serving.install as server_install
from tfgraph.cli import main
from tfgraph.errors import TfgraphError
from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner
from tfgraph.runtime.serving.launcher import find_tritonserver, loadable_models

try:
    find_tritonserver()
    _MISSING = None
except TfgraphError as exc:
    _MISSING = str(exc)
needs_server = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton-command") / "llama"
    assert tfgraph.export("llama-tiny", out, kv_cache=True).passed
    return out


class _NoGrpc(importlib.abc.MetaPathFinder):
    """``tritonclient`` installed without its ``grpc`` extra: importing ``tritonclient.grpc``
    raises the RuntimeError its ``__init__`` raises then."""

    def find_spec(self, name, path=None, target=None):
        if name == "tritonclient.grpc" or name.startswith("tritonclient.grpc."):
            raise RuntimeError("The installation does not include grpc support.")
        return None


def test_tritonclient_without_grpc_is_one_error_line(llama, tmp_path, monkeypatch, capsys):
    pytest.importorskip("tritonclient")
    for name in [n for n in sys.modules if n.startswith("tritonclient.grpc")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NoGrpc(), *sys.meta_path])
    out = tmp_path / "repo"
    assert main(["triton", str(llama), "-o", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "pip install 'tritonclient[grpc]'" in lines[0]
    assert not out.exists()


def test_tritonserver_without_the_server_environment_is_one_error_line(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(server_install.ENV_VAR, str(tmp_path / "nowhere"))
    (tmp_path / "repo").mkdir()
    assert main(["tritonserver", str(tmp_path / "repo")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and server_install.INSTALL_COMMAND in lines[0], lines


def test_only_models_with_a_backend_here_are_loaded(tmp_path):
    backends = tmp_path / "backends"
    (backends / "python").mkdir(parents=True)
    repo = tmp_path / "repo"
    for name, line in [("m", 'backend: "onnxruntime"'), ("m_generate", 'backend: "python"'),
                       ("m_trt", 'platform: "tensorrt_plan"')]:  # fmt: skip
        (repo / name).mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(f'name: "{name}"\n{line}\n')
    load, skipped = loadable_models(repo, SimpleNamespace(backends_dir=backends))
    assert load == ["m_generate"]
    assert skipped == {"m": "no onnxruntime backend in this tritonserver",
                       "m_trt": "no tensorrt backend in this tritonserver"}  # fmt: skip


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except (urllib.error.URLError, OSError):
        return 0


@needs_server
def test_the_printed_command_starts_the_server(llama, tmp_path, capsys):
    """The ``serve:`` line's command, run as printed (the venv's ``bin`` on PATH, as after
    ``pip install -e .``), serves the generation model until Ctrl-C, then stops it."""
    pytest.importorskip("tritonclient.grpc")
    repo = tmp_path / "repo"
    assert main(["triton", str(llama), "-o", str(repo)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("serve: "))
    command = shlex.split(line.removeprefix("serve: ").split(" (stream")[0])
    assert command == ["tfgraph", "tritonserver", str(repo)]
    http, grpc, metrics = _free_ports(3)
    ports = ["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                                   os.environ.get("PATH", "")])}  # fmt: skip
    process = subprocess.Popen([*command, *ports], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               preexec_fn=terminal_signals)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while _get(f"http://127.0.0.1:{http}/v2/models/llama_generate/ready") != 200:
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "not ready after 120 s"
            time.sleep(0.2)
        body = json.dumps({"input_ids": [5, 6, 7], "max_new_tokens": 5}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{http}/v2/models/llama_generate/generate", data=body,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        decoder = CachedDecoder(open_runner(llama / "model.onnx"))
        want = generate(decoder, [[5, 6, 7]], GenerationConfig(max_new_tokens=5)).tokens[0]
        assert [int(t) for t in answer["token_id"]] == want
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, output
    assert "loading llama_generate" in output and "not loading llama:" in output
    assert "Traceback" not in output, output
    assert _get(f"http://127.0.0.1:{http}/v2/health/live") == 0  # the server is gone
