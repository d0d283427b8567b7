"""TritonServer runs a real tritonserver (from the server environment's nvidia-pytriton wheel)
on the CPU, its Python backend on the server environment's numpy<2 while this process may run
NumPy 2."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tfgraph.runtime.serving.install as server_install
from tfgraph.errors import TfgraphError
from tfgraph.runtime.serving.launcher import TritonServer, find_tritonserver, python_site_paths

try:
    find_tritonserver()
    _MISSING = None
except TfgraphError as exc:
    _MISSING = str(exc)
needs_server = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


CONFIG = """\
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
parameters {{ key: "python_paths" value {{ string_value: {paths} }} }}
"""

# numpy and tfgraph are importable only once the paths from the config are added.
MODEL = """\
import json
import site
import sys

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        paths = params["python_paths"]["string_value"].split({pathsep!r})
        for path in paths:
            site.addsitedir(path)  # appended; runs .pth files: the editable install of tfgraph
        global np
        import numpy as np

        print(f"add_one: numpy {{np.__version__}} at {{np.__file__}}", flush=True)

        import tfgraph.errors  # noqa: F401  (tfgraph imports inside the stub)
        {fail}

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            y = (x + np.float32(1)).astype(np.float32)
            out = pb_utils.Tensor("OUTPUT0", y)
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
"""


def write_add_one(repository, name="add_one", fail=""):
    model = repository / name
    (model / "1").mkdir(parents=True)
    paths = os.pathsep.join(python_site_paths())
    (model / "config.pbtxt").write_text(CONFIG.format(paths=f'"{paths}"'))
    code = MODEL.format(pathsep=os.pathsep, fail=fail)
    (model / "1" / "model.py").write_text(textwrap.dedent(code))
    return model


def test_missing_server_env_is_one_line_naming_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv(server_install.ENV_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(TfgraphError) as info:
        TritonServer(tmp_path).start()
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "nowhere") in message
    assert server_install.INSTALL_COMMAND in message
    result = subprocess.run(
        [sys.executable, "-m", "tfgraph.runtime.serving.install", "--check"],
        capture_output=True,
        text=True,
        env={**os.environ, server_install.ENV_VAR: str(tmp_path / "nowhere")},
        timeout=120,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and server_install.INSTALL_COMMAND in result.stderr


def test_server_requirements_pin_numpy_1_and_follow_tfgraph():
    wanted = server_install.requirements()
    assert wanted[0] == "numpy<2"
    names = [server_install._normalize(r.split(">")[0].split("=")[0]) for r in wanted[1:]]
    assert names == list(server_install.RUNTIME)
    assert any(r.startswith("onnxruntime>=") for r in wanted)  # tfgraph's own specifier


@needs_server
def test_finds_wheel_and_site_paths():
    install = find_tritonserver()
    assert install.binary.is_file() and install.stub.is_file()
    assert install.stub.parent.name == install.python_version
    assert (install.python_bin / "python3").exists()
    assert any(p.endswith("site-packages") for p in python_site_paths())


@needs_server
def test_serves_add_one_over_http_and_grpc(tmp_path):
    grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install -e '.[serve]'")
    httpclient = pytest.importorskip("tritonclient.http", reason="pip install -e '.[serve]'")

    write_add_one(tmp_path / "repo")
    x = np.array([0.0, 1.5, -2.0, 41.0], dtype=np.float32)
    with TritonServer(tmp_path / "repo", load=["add_one"]) as server:
        process = server.process
        assert server.is_model_ready("add_one")

        http = httpclient.InferenceServerClient(server.http_url)
        inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        y = http.infer("add_one", [inp]).as_numpy("OUTPUT0")
        assert y.tolist() == [1.0, 2.5, -1.0, 42.0]

        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        y = grpc.infer("add_one", [inp]).as_numpy("OUTPUT0")
        assert y.tolist() == [1.0, 2.5, -1.0, 42.0]
        grpc.close()

        server.unload("add_one")
        assert not server.is_model_ready("add_one")
        assert not http.is_model_ready("add_one")
        server.load("add_one")
        assert server.is_model_ready("add_one")
        assert http.is_model_ready("add_one")
        http.close()
    assert process.poll() is not None
    assert "add_one" in server.log_text()
    # the stub ran the server environment's NumPy 1, whatever this process runs
    env = server_install.find_server_env()
    line = next(x for x in server.log_text().splitlines() if x.startswith("add_one: numpy"))
    version, where = line.split()[2], line.split(" at ")[1]
    assert int(version.split(".")[0]) < 2 and where.startswith(str(env.site_packages))


@needs_server
def test_model_that_fails_to_load_raises_with_log_tail(tmp_path):
    write_add_one(tmp_path / "repo", fail='raise RuntimeError("tfgraph-test-boom")')
    server = TritonServer(tmp_path / "repo", load=["add_one"], startup_timeout=45)
    with pytest.raises(TfgraphError) as info:
        with server:
            pass
    assert "log tail" in str(info.value)
    assert "tfgraph-test-boom" in str(info.value)
    assert server.process is not None and server.process.poll() is not None


@needs_server
def test_startup_timeout_stops_server(tmp_path):
    write_add_one(tmp_path / "repo", fail="import time; time.sleep(60)")
    server = TritonServer(tmp_path / "repo", load=["add_one"], startup_timeout=3)
    with pytest.raises(TfgraphError, match="not ready after 3 s"):
        server.start()
    assert server.process.poll() is not None


def test_a_ctrl_c_on_another_thread_stops_the_foreground_wait():
    """A signal the kernel hands to a thread other than the main one (this process has ONNX
    Runtime's and torch's) does not cut a bare ``waitpid`` short; the foreground wait still
    raises within a fraction of a second, not when the server exits on its own."""
    import signal
    import threading
    import time

    from tfgraph.runtime.serving.launcher import _wait_interruptibly

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run in the main thread only; this runner is not on it")
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])

    def interrupt_from_this_thread():
        time.sleep(0.3)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    other = threading.Thread(target=interrupt_from_this_thread)
    # Ctrl-C's handler, as in a terminal (a test runner's worker may have SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    other.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            _wait_interruptibly(process)
        assert time.monotonic() - started < 5
    finally:
        other.join()
        signal.signal(signal.SIGINT, previous)
        process.kill()
        process.wait()
