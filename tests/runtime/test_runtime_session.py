"""tfgraph.runtime.Session on numpy and torch inputs, and its errors."""

import numpy as np
import onnx_ir as ir
import pytest
import torch

from tfgraph import TfgraphError
from tfgraph.runtime import Session

TEXT = """
<ir_version: 10, opset_import: ["" : 20]>
g (float[N, 3] x, int64[N] k) => (float[N, 3] y) {
    kf = Cast<to = 1>(k)
    kk = Unsqueeze(kf, axes)
    y = Mul(x, kk)
}
"""


@pytest.fixture
def model_dir(tmp_path):
    model = ir.from_onnx_text(TEXT.replace("Unsqueeze(kf, axes)", "Unsqueeze(kf, one)"))
    one = ir.Value(name="one", const_value=ir.tensor(np.array([1], dtype=np.int64)))
    model.graph.register_initializer(one)
    node = next(n for n in model.graph if n.op_type == "Unsqueeze")
    node.replace_input_with(1, one)
    ir.save(model, tmp_path / "model.onnx")
    return tmp_path


def test_numpy_and_torch_inputs_agree(model_dir):
    session = Session(model_dir)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    k = np.array([2, 3])
    want = x * k[:, None]
    np.testing.assert_array_equal(session.run({"x": x, "k": k})["y"], want)
    got = session.run({"x": torch.from_numpy(x), "k": torch.tensor([2, 3])})["y"]
    np.testing.assert_array_equal(got, want)
    # float64 arrays are cast to the model's float32
    np.testing.assert_array_equal(session.run({"x": x.astype(np.float64), "k": k})["y"], want)


def test_wrong_inputs(model_dir):
    session = Session(model_dir)
    with pytest.raises(TfgraphError, match=r"missing \['k'\]"):
        session.run({"x": np.zeros((1, 3), np.float32)})
    with pytest.raises(TfgraphError, match="dtype float32, the model wants int64"):
        session.run({"x": np.zeros((1, 3), np.float32), "k": np.zeros(1, np.float32)})


def test_provider_not_installed(model_dir):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has CUDA: the error path cannot be reached")
    with pytest.raises(TfgraphError, match="provider 'cuda' is not in this ONNX Runtime"):
        Session(model_dir, providers=["cuda"])


def test_missing_and_corrupt_model(tmp_path):
    with pytest.raises(TfgraphError, match="no ONNX model"):
        Session(tmp_path)
    (tmp_path / "model.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(TfgraphError, match="cannot load"):
        Session(tmp_path)


MATMUL = """
<ir_version: 10, opset_import: ["" : 20]>
g (float[N, 64] x) => (float[N, 64] y) {
    y = MatMul(x, w)
}
"""


def _matmul_dir(tmp_path, quantized: bool):
    """``y = x @ w``; quantized: ``w`` is an int8 weight through ``DequantizeLinear``."""
    rng = np.random.default_rng(0)
    model = ir.from_onnx_text(MATMUL.replace("MatMul(x, w)", "MatMul(x, wt)"))
    w = rng.standard_normal((64, 64), np.float32)
    node = next(iter(model.graph))
    if quantized:
        scale = np.float32(np.abs(w).max() / 127)
        wq = np.round(w / scale).astype(np.int8)
        w = wq.astype(np.float32) * scale
        q = ir.Value(name="wq", const_value=ir.tensor(wq))
        s = ir.Value(name="scale", const_value=ir.tensor(np.array(scale)))
        for value in (q, s):
            model.graph.register_initializer(value)
        dq = ir.node("DequantizeLinear", [q, s])
        model.graph.insert_before(node, dq)
        node.replace_input_with(1, dq.outputs[0])
    else:
        value = ir.Value(name="wt", const_value=ir.tensor(w))
        model.graph.register_initializer(value)
        node.replace_input_with(1, value)
    ir.save(model, tmp_path / "model.onnx")
    return tmp_path, rng.standard_normal((3, 64), np.float32), w


def test_a_checking_session_reads_float_weights_in_place(tmp_path):
    path, x, w = _matmul_dir(tmp_path, quantized=False)
    deployed, checking = Session(path), Session(path, checking=True)
    assert deployed.prepacked and not checking.prepacked
    entry = checking._session.get_session_options().get_session_config_entry
    assert entry("session.disable_prepacking") == "1"
    # the same kernels, packed per call: the results agree with numpy's to fp32 rounding
    for session in (deployed, checking):
        np.testing.assert_allclose(session.run({"x": x})["y"], x @ w, rtol=1e-5, atol=1e-5)
    assert checking.sibling("model.onnx").prepacked is False


def test_a_checking_session_keeps_prepacking_for_quantized_weights(tmp_path):
    path, x, w = _matmul_dir(tmp_path, quantized=True)
    checking = Session(path, checking=True)
    assert checking.prepacked
    options = checking._session.get_session_options()
    with pytest.raises(RuntimeError, match="does not have configuration"):
        options.get_session_config_entry("session.disable_prepacking")  # never set
    # ORT may fuse DequantizeLinear + MatMul into an int8 kernel that also quantizes x: close
    # to the dequantized product, not equal to it
    got, want = checking.run({"x": x})["y"], x @ w
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.02


def test_spinning_off_sets_the_session_entry(model_dir):
    """spinning=False (a speculative target and its draft) tells ONNX Runtime's intra-op
    threads not to spin-wait; the default leaves ONNX Runtime's own choice."""
    key = "session.intra_op.allow_spinning"
    quiet = Session(model_dir, spinning=False)._session.get_session_options()
    assert quiet.get_session_config_entry(key) == "0"
    default = Session(model_dir)._session.get_session_options()
    with pytest.raises(RuntimeError, match="does not have configuration"):
        default.get_session_config_entry(key)  # unset: ONNX Runtime's default (spinning)
    x = np.ones((1, 3), np.float32)
    got = Session(model_dir, spinning=False).run({"x": x, "k": np.array([4])})["y"]
    np.testing.assert_array_equal(got, x * 4)
