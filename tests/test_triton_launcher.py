"""TritonServer runs a real tritonserver (from the nvidia-pytriton wheel) on the CPU."""

import importlib.util
import os
import textwrap

import numpy as np
import pytest

from tfgraph.errors import TfgraphError
from tfgraph.serving.launcher import TritonServer, find_tritonserver, python_site_paths

for _dist, _module in [
    ("nvidia-pytriton", "pytriton"),
    ("tritonclient[http,grpc]", "tritonclient"),
]:
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"needs the {_dist} wheel (pip install -e '.[serve]')", allow_module_level=True)

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
        for path in reversed(paths):
            sys.path.insert(0, path)
        for path in paths:
            site.addsitedir(path)  # runs .pth files: the editable install of tfgraph
        global np
        import numpy as np

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


def test_finds_wheel_and_site_paths():
    install = find_tritonserver()
    assert install.binary.is_file() and install.stub.is_file()
    assert install.stub.parent.name == install.python_version
    assert any(p.endswith("site-packages") for p in python_site_paths())


def test_serves_add_one_over_http_and_grpc(tmp_path):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

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


def test_model_that_fails_to_load_raises_with_log_tail(tmp_path):
    write_add_one(tmp_path / "repo", fail='raise RuntimeError("tfgraph-test-boom")')
    server = TritonServer(tmp_path / "repo", load=["add_one"], startup_timeout=45)
    with pytest.raises(TfgraphError) as info:
        with server:
            pass
    assert "log tail" in str(info.value)
    assert "tfgraph-test-boom" in str(info.value)
    assert server.process is not None and server.process.poll() is not None


def test_startup_timeout_stops_server(tmp_path):
    write_add_one(tmp_path / "repo", fail="import time; time.sleep(60)")
    server = TritonServer(tmp_path / "repo", load=["add_one"], startup_timeout=3)
    with pytest.raises(TfgraphError, match="not ready after 3 s"):
        server.start()
    assert server.process.poll() is not None
