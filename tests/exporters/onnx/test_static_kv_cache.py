"""StaticKVCachePass: the onnx and tensorrt targets' KV cache as preallocated buffers written
in place by TensorScatter-24, the attention reading the whole buffer with the padding masked."""

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from ort_run import ort_session

import tfgraph
from tfgraph import contract
from tfgraph.exporters.onnx.static_kv_cache import StaticKVCachePass
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, generate


@pytest.fixture(scope="module")
def llama_onnx(tmp_path_factory):
    out = tmp_path_factory.mktemp("static") / "llama"
    assert tfgraph.export("llama-tiny", out, kv_cache=True, target="onnx").passed
    return out


def test_the_graph_writes_buffers_in_place(llama_onnx):
    model = onnx.load(llama_onnx / "model.onnx")
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("TensorScatter") == 4 and ops.count("Attention") == 2
    assert ops.count("Pad") == 2  # each layer's causal mask grown to the buffer, -inf beyond
    pasts = {i.name for i in model.graph.input if i.name.startswith("past_key_values")}
    for node in model.graph.node:
        if set(node.input) & pasts:  # a past is read only by its TensorScatter or a Shape
            assert node.op_type in ("TensorScatter", "Shape"), node.op_type
    assert {o.domain: o.version for o in model.opset_import}[""] == 24
    past = next(i for i in model.graph.input if i.name == "past_key_values.0.key")
    assert past.type.tensor_type.shape.dim[2].dim_param == contract.BUFFER_DIM
    names = [i.name for i in model.graph.input]
    assert contract.PAST_LENGTH_NAME in names


def test_a_longer_buffer_gives_the_same_tokens(llama_onnx):
    """Positions past the valid ones are masked: greedy steps in a 64-position buffer give the
    tokens generate() gets from a buffer just long enough."""
    decoder = CachedDecoder(Session(llama_onnx))
    prompts = [[5, 17, 3, 9], [7, 2, 11, 4]]  # llama-tiny takes no mask: equal lengths
    want = generate(decoder, prompts, GenerationConfig(max_new_tokens=12)).tokens
    cache = decoder.empty_cache(2, 64)
    tokens, got = np.array(prompts), [[], []]
    for _ in range(12):
        logits, cache = decoder.step(tokens, cache, None, {})
        tokens = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        for row in range(2):
            got[row].append(int(tokens[row, 0]))
    assert got == want


def _toy(extra_use: bool) -> ir.Model:
    """A lowered one-layer cached attention: present = Concat(past, new) read by Attention."""
    h = onnx.helper
    f = onnx.TensorProto.FLOAT
    nodes = [
        h.make_node("Concat", ["past_k", "k"], ["present_k"], axis=2),
        h.make_node("Concat", ["past_v", "v"], ["present_v"], axis=2),
        h.make_node("Attention", ["q", "present_k", "present_v"], ["y"]),
    ]
    outputs = ["y", "present_k", "present_v"]
    if extra_use:  # something else reads the past: the pass must leave the graph alone
        nodes.append(h.make_node("Identity", ["past_k"], ["copy"]))
        outputs.append("copy")
    shape = ["b", 2, "s", 4]
    graph = h.make_graph(
        nodes,
        "toy",
        [h.make_tensor_value_info(n, f, shape) for n in ("q", "k", "v", "past_k", "past_v")],
        [h.make_tensor_value_info(n, f, None) for n in outputs],
    )
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 23)])
    model = ir.serde.deserialize_model(proto)
    contract.set_role(model, "past_k", contract.PAST_KEY, 0)
    contract.set_role(model, "past_v", contract.PAST_VALUE, 0)
    contract.set_role(model, "present_k", contract.PRESENT_KEY, 0)
    contract.set_role(model, "present_v", contract.PRESENT_VALUE, 0)
    return model


def test_an_attention_without_a_mask_gets_the_padding_mask():
    model = _toy(extra_use=False)
    assert StaticKVCachePass()(model).modified
    attention = next(n for n in model.graph if n.op_type == "Attention")
    assert attention.inputs[3] is not None  # the valid-keys mask
    assert model.metadata_props[contract.KV_LAYOUT_KEY] == "static"
    session = ort_session(model)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 1, 4)).astype(np.float32) for _ in range(3))
    past_k = np.zeros((1, 2, 8, 4), np.float32)
    past_v = np.zeros((1, 2, 8, 4), np.float32)
    past_k[:, :, :3] = rng.standard_normal((1, 2, 3, 4))
    past_v[:, :, :3] = rng.standard_normal((1, 2, 3, 4))
    feeds = {"q": q, "k": k, "v": v, "past_k": past_k, "past_v": past_v}
    y = session.run(["y"], {**feeds, contract.PAST_LENGTH_NAME: np.array([3])})[0]
    keys = np.concatenate([past_k[:, :, :3], k], 2)
    values = np.concatenate([past_v[:, :, :3], v], 2)
    scores = q @ keys.transpose(0, 1, 3, 2) / 2.0
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    np.testing.assert_allclose(y, weights @ values, atol=1e-5)


def test_a_past_read_elsewhere_keeps_the_copying_cache():
    model = _toy(extra_use=True)
    assert not StaticKVCachePass()(model).modified
    assert any(n.op_type == "Concat" for n in model.graph)


def test_shapes_computed_from_a_buffer_forget_the_total_length():
    """Shape inference before the pass annotated the keys' transpose and the scores with the
    copying cache's ``total`` length; over a buffer that axis is its capacity, and ONNX
    Runtime, trusting the stale name, took the scores (over C positions) for the size of a
    bias over the L valid keys, also named ``total`` (HF T5 on tensorrt: "Shape mismatch
    attempting to re-use buffer"). Those shapes are dropped; the graph runs."""
    h = onnx.helper
    f = onnx.TensorProto.FLOAT
    nodes = [
        h.make_node("Concat", ["past_k", "k"], ["present_k"], axis=2),
        h.make_node("Concat", ["past_v", "v"], ["present_v"], axis=2),
        h.make_node("Transpose", ["present_k"], ["kt"], perm=[0, 1, 3, 2]),
        h.make_node("MatMul", ["q", "kt"], ["scores"]),
        h.make_node("Add", ["scores", "bias"], ["biased"]),
        h.make_node("Softmax", ["biased"], ["probs"], axis=-1),
        h.make_node("MatMul", ["probs", "present_v"], ["y"]),
    ]
    kv = ["b", 2, "past", 4]
    graph = h.make_graph(
        nodes,
        "decomposed",
        [
            h.make_tensor_value_info("q", f, ["b", 2, "t", 4]),
            *(h.make_tensor_value_info(n, f, ["b", 2, "t", 4]) for n in ("k", "v")),
            *(h.make_tensor_value_info(n, f, kv) for n in ("past_k", "past_v")),
            h.make_tensor_value_info("bias", f, ["b", 2, "t", "total"]),
        ],
        [
            h.make_tensor_value_info("y", f, ["b", 2, "t", 4]),
            *(
                h.make_tensor_value_info(n, f, ["b", 2, "total", 4])
                for n in ("present_k", "present_v")
            ),
        ],
        value_info=[
            h.make_tensor_value_info("kt", f, ["b", 2, 4, "total"]),
            h.make_tensor_value_info("scores", f, ["b", 2, "t", "total"]),
            h.make_tensor_value_info("biased", f, ["b", 2, "t", "total"]),
            h.make_tensor_value_info("probs", f, ["b", 2, "t", "total"]),
        ],
    )
    model = ir.serde.deserialize_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)]))
    for name, role in (("past_k", contract.PAST_KEY), ("past_v", contract.PAST_VALUE)):
        contract.set_role(model, name, role, 0)
    contract.set_role(model, "present_k", contract.PRESENT_KEY, 0)
    contract.set_role(model, "present_v", contract.PRESENT_VALUE, 0)
    assert StaticKVCachePass()(model).modified
    for node in model.graph:
        for out in node.outputs:
            names = [str(d) for d in out.shape] if out.shape is not None else []
            assert "total" not in names, (out.name, out.shape)
    session = ort_session(model)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for _ in range(3))
    buffer = np.zeros((1, 2, 5, 4), np.float32)
    bias = rng.standard_normal((1, 2, 3, 3)).astype(np.float32)
    feeds = {"q": q, "k": k, "v": v, "past_k": buffer, "past_v": buffer, "bias": bias}
    y = session.run(["y"], {**feeds, contract.PAST_LENGTH_NAME: np.array([0])})[0]
    scores = q @ k.transpose(0, 1, 3, 2) + bias
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    np.testing.assert_allclose(y, weights @ v, atol=1e-5)
