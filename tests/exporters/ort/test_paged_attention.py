"""PagedAttention on ``ort-cuda`` (passes/paged_attention.py), checked without a GPU.

ONNX Runtime 1.32 has no CPU kernel for ``com.microsoft.PagedAttention``, so what runs here is:
the rewrite of an exported llama-tiny (every cached GroupQueryAttention paged, the new inputs'
roles and shapes, the layout in the metadata); the graph's well-formedness (ONNX checker and
strict shape inference; ONNX Runtime's CPU session stops at kernel assignment, not earlier);
and the mapping between the two layouts, numerically: a one-layer graph is paged by the pass
and run by ``onnx.reference`` with a numpy reading of PagedAttention's schema, against ONNX
Runtime's GroupQueryAttention on the contiguous buffer it replaced. The CUDA kernel's own
numerics and speed wait for a GPU.
"""

import json

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from ort_run import run_onnx

import tfgraph
from tfgraph import contract
from tfgraph.exporters.compile import check_model
from tfgraph.exporters.ort.paged_attention import PagedAttentionPass, lower_to_paged

BLOCK = 16
NO_KERNEL = "Could not find an implementation for PagedAttention(1)"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """llama-tiny for ort-cuda in fp16 (PagedAttention takes no float32), KV cache on: the
    shared buffer with per-row lengths, before and after paging."""
    out = tmp_path_factory.mktemp("paged") / "llama-tiny"
    result = tfgraph.export("llama-tiny", out, kv_cache=True, target="ort-cuda", precision="fp16")
    assert result.passed
    before = ir.load(out / contract.MODEL_FILE)
    after = ir.load(out / contract.MODEL_FILE)
    paging = PagedAttentionPass(BLOCK)
    modified = paging(after).modified
    return before, after, modified, paging


def _ops(model: ir.Model, op: str) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == op]


def test_every_cached_gqa_becomes_paged(llama):
    before, after, modified, paging = llama
    layers = contract.signature_of(before).cache_layers
    assert modified and paging.refused is None
    assert len(_ops(before, "GroupQueryAttention")) == len(layers) == 2
    assert len(_ops(after, "PagedAttention")) == len(layers)
    assert not _ops(after, "GroupQueryAttention")
    assert all(n.domain == "com.microsoft" for n in _ops(after, "PagedAttention"))
    assert PagedAttentionPass(BLOCK)(after).modified is False  # a paged graph is left alone


def test_new_inputs_have_roles_and_shapes(llama):
    before, after, _, _ = llama
    signature = contract.signature_of(after)
    assert not signature.inputs_with(contract.PAST_KEY, contract.PAST_VALUE)
    assert not [p for p in signature.outputs if p.role in contract.PRESENT_OF.values()]
    for layer in (0, 1):
        for role in (contract.KEY_BLOCKS, contract.VALUE_BLOCKS):
            port, out = signature.input(role, layer), signature.output(role, layer)
            assert port.name == contract.BLOCK_NAMES[role].format(layer)
            assert port.dtype == out.dtype == "float16"
            assert port.shape == out.shape == [contract.BLOCKS_DIM, BLOCK, 2, 8]
            assert out.name == contract.PRESENT_BLOCK_NAMES[role].format(layer)
    table = signature.input(contract.BLOCK_TABLE)
    assert (table.name, table.dtype) == (contract.BLOCK_TABLE_NAME, "int32")
    assert table.shape == ["batch", contract.TABLE_DIM]
    lengths = signature.input(contract.PAST_LENGTHS)
    assert (lengths.dtype, lengths.shape) == ("int64", ["batch"])
    assert signature.input(contract.TOKEN_IDS).shape == ["batch", "sequence"]  # not packed
    assert after.metadata_props[contract.KV_LAYOUT_KEY] == "paged"
    layout = json.loads(after.metadata_props[contract.KV_PAGED_KEY])
    assert layout["block_size"] == BLOCK and layout["layers"] == 2
    assert layout["present_aliases_past"]["present.1.value_blocks"] == "value_blocks.1"
    assert signature.kv_layout == layout  # the manifest states the paged layout as recorded


def test_export_pages_after_parity_and_states_what_is_unverified(tmp_path):
    """``--kv-layout paged``: parity runs on the shared-buffer graph, then the artifact is
    paged, saved again and its session checked; the manifest and the report say so, and the
    runtime refuses the artifact with the reason (it has no block allocator)."""
    from tfgraph.errors import TfgraphError
    from tfgraph.runtime import Session

    out = tmp_path / "paged"
    result = tfgraph.export(
        "llama-tiny", out, kv_cache=True, target="ort-cuda", precision="fp16", kv_layout="paged",
        kv_block_size=32,
    )  # fmt: skip
    assert result.passed and result.report["parity"]["rows"]["passed"]
    paged = result.report["paged"]
    assert (paged["layers"], paged["block_size"]) == (2, 32)
    assert "stopped at kernel assignment" in paged["session_check"]
    assert "unverified" in paged["parity"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kv_layout"]["kind"] == "paged" and manifest["kv_layout"]["block_size"] == 32
    assert manifest["fusions"]["attention"] == {"fused": 2, "total": 2}
    names = {i["name"] for i in manifest["inputs"]}
    assert {"block_table", "key_blocks.0", "value_blocks.1"} <= names
    assert not any(n.startswith("past_key_values") for n in names)
    saved = ir.load(out / contract.MODEL_FILE)
    assert len(_ops(saved, "PagedAttention")) == 2 and not _ops(saved, "GroupQueryAttention")
    with pytest.raises(TfgraphError, match="no block allocator"):
        Session(out)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"target": "ort", "precision": "fp16"}, "export with --target ort-cuda"),
        ({"target": "ort-cuda"}, "needs --precision fp16"),
        ({"target": "ort-cuda", "precision": "fp16", "kv_block_size": 24}, "power of two"),
        ({"target": "ort-cuda", "precision": "fp16", "kv_cache": False}, "add --kv-cache"),
    ],
)
def test_a_paged_cache_the_export_cannot_build_is_refused_first(tmp_path, fields, message):
    from tfgraph.errors import TfgraphError

    fields = {"kv_cache": True, **fields}
    with pytest.raises(TfgraphError, match=message):
        tfgraph.export("llama-tiny", tmp_path / "a", kv_layout="paged", **fields)
    assert not (tmp_path / "a").exists()


def test_graph_is_well_formed_and_only_the_kernel_is_missing(llama, tmp_path):
    """ONNX's checker and strict shape inference pass; ONNX Runtime's CPU session resolves the
    graph and its types and stops at kernel assignment. A type error stops it earlier, with
    INVALID_GRAPH: the negative control shows the assertion tells the two apart."""
    _, after, _, _ = llama
    # ONNX checker + strict shape inference (ort-cuda's default-domain
    # SimplifiedLayerNormalization shown to the checker as a custom op, as the pipeline does)
    check_model(after, "PagedAttentionPass", "ort-cuda")
    path = tmp_path / "paged.onnx"
    ir.save(after, path)
    # raw sessions: what is tested is what ONNX Runtime itself refuses when it loads the graph
    with pytest.raises(Exception, match="NOT_IMPLEMENTED") as caught:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert NO_KERNEL in str(caught.value)

    table = next(v for v in after.graph.inputs if v.name == contract.BLOCK_TABLE_NAME)
    table.type = ir.TensorType(ir.DataType.INT64)  # PagedAttention's S is int32 only
    ir.save(after, tmp_path / "wrong.onnx")
    table.type = ir.TensorType(ir.DataType.INT32)
    with pytest.raises(Exception, match="INVALID_GRAPH") as caught:
        ort.InferenceSession(str(tmp_path / "wrong.onnx"), providers=["CPUExecutionProvider"])
    assert NO_KERNEL not in str(caught.value)


# --- the layout mapping, numerically, on one layer ------------------------------------------

HQ, HKV, D = 4, 2, 8


def _one_layer(dtype: int, capacity: int, shared: bool = True) -> ir.Model:
    """One cached GroupQueryAttention as ``gqa_past`` builds it over a shared buffer with
    per-row lengths: seqlens_k = P_b + T − 1, total = P + T."""
    f = lambda name, shape: helper.make_tensor_value_info(name, dtype, shape)  # noqa: E731
    i64 = lambda name, shape: helper.make_tensor_value_info(  # noqa: E731
        name, TensorProto.INT64, shape
    )
    cache = ["batch", HKV, "max_sequence", D]
    inputs = [
        f("q", ["batch", "sequence", HQ * D]),
        f("k", ["batch", "sequence", HKV * D]),
        f("v", ["batch", "sequence", HKV * D]),
        f("past_key_values.0.key", cache),
        f("past_key_values.0.value", cache),
        i64(contract.PAST_LENGTH_NAME, [1]),
        i64(contract.PAST_LENGTHS_NAME, ["batch"]),
    ]
    outputs = [f("y", ["batch", "sequence", HQ * D]), f("present.0.key", cache),
               f("present.0.value", cache)]  # fmt: skip
    nodes = [
        helper.make_node("Shape", ["q"], ["t"], start=1, end=2),
        helper.make_node("Constant", [], ["one"], value_ints=[1]),
        helper.make_node("Add", [contract.PAST_LENGTHS_NAME, "t"], ["ends"]),
        helper.make_node("Sub", ["ends", "one"], ["seqlens64"]),
        helper.make_node("Cast", ["seqlens64"], ["seqlens"], to=TensorProto.INT32),
        helper.make_node("Add", [contract.PAST_LENGTH_NAME, "t"], ["total64"]),
        helper.make_node("Squeeze", ["total64"], ["total0"]),
        helper.make_node("Cast", ["total0"], ["total"], to=TensorProto.INT32),
        helper.make_node(
            "GroupQueryAttention",
            ["q", "k", "v", "past_key_values.0.key", "past_key_values.0.value", "seqlens",
             "total"],
            ["y", "present.0.key", "present.0.value"],
            domain="com.microsoft", num_heads=HQ, kv_num_heads=HKV, scale=D**-0.5, causal=1,
        ),
    ]  # fmt: skip
    graph = helper.make_graph(nodes, "one_layer", inputs, outputs)
    proto = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]
    )
    model = ir.serde.deserialize_model(proto)
    roles = {
        "q": (contract.INPUT, None),
        "k": (contract.INPUT, None),
        "v": (contract.INPUT, None),
        "y": (contract.OUTPUT, None),
        contract.PAST_LENGTH_NAME: (contract.PAST_LENGTH, None),
        contract.PAST_LENGTHS_NAME: (contract.PAST_LENGTHS, None),
    }
    for role in (contract.PAST_KEY, contract.PAST_VALUE):
        roles[contract.tensor_name(role, 0)] = (role, 0)
        present = contract.PRESENT_OF[role]
        roles[contract.tensor_name(present, 0)] = (present, 0)
    contract.write_roles(model, roles)
    if shared:
        model.metadata_props[contract.KV_LAYOUT_KEY] = "shared"
    model.metadata_props[contract.ROW_LENGTHS_KEY] = "per_row"
    return model


def paged_attention(query, key, value, key_cache, value_cache, cumulative, past, table, *,
                    num_heads, kv_num_heads, scale=None):  # fmt: skip
    """PagedAttention as its ONNX Runtime 1.32 schema states it: packed tokens, row b's new
    tokens at cumulative[b] … cumulative[b+1], written at positions past[b] … (block
    table[b, pos // block], offset pos % block) before the causal attention over the row's
    past + new keys (bottom-right aligned)."""
    block = key_cache.shape[1]
    d = query.shape[1] // num_heads
    scale = scale or d**-0.5
    kc, vc = key_cache.copy(), value_cache.copy()
    out = np.zeros(query.shape, np.float32)
    for b in range(len(past)):
        start, n, p = cumulative[b], cumulative[b + 1] - cumulative[b], past[b]
        for t in range(n):
            pos = p + t
            where = table[b, pos // block], pos % block
            kc[where] = key[start + t].reshape(kv_num_heads, d)
            vc[where] = value[start + t].reshape(kv_num_heads, d)
        pos = np.arange(p + n)
        keys = kc[table[b, pos // block], pos % block].astype(np.float32)  # (L, Hkv, d)
        values = vc[table[b, pos // block], pos % block].astype(np.float32)
        q = query[start : start + n].reshape(n, num_heads, d).astype(np.float32)
        allowed = pos[None, :] <= p + np.arange(n)[:, None]  # (n, L)
        for h in range(num_heads):
            kv = h // (num_heads // kv_num_heads)
            scores = np.where(allowed, q[:, h] @ keys[:, kv].T * scale, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out[start : start + n, h * d : (h + 1) * d] = probs @ values[:, kv]
    return out.astype(query.dtype), kc, vc


class PagedAttention(OpRun):  # onnx.reference finds a new op by its class name
    op_domain = "com.microsoft"

    def _run(self, *inputs, num_heads=None, kv_num_heads=None, scale=None):
        return paged_attention(*inputs[:8], num_heads=num_heads, kv_num_heads=kv_num_heads,
                               scale=scale)  # fmt: skip


def _to_blocks(buffer, past, table, num_blocks):
    """The contiguous (B, Hkv, S, d) buffer's first past[b] positions in block pools."""
    pool = np.zeros((num_blocks, BLOCK, HKV, D), buffer.dtype)
    for b, p in enumerate(past):
        for pos in range(p):
            pool[table[b, pos // BLOCK], pos % BLOCK] = buffer[b, :, pos]
    return pool


@pytest.mark.parametrize("past", [[5, 0, 37], [21]], ids=["decode-3-rows", "chunk-1-row"])
def test_paged_layout_matches_the_contiguous_buffer(past):
    """Decode (T = 1) of three rows at different past lengths, and a 3-token chunk of one row
    (ONNX Runtime's GQA takes T > 1 over a past for one row only): the paged graph, run by
    the reference, gives GQA's output, and its pools hold GQA's present buffer."""
    rng = np.random.default_rng(0)
    t = 1 if len(past) > 1 else 3
    batch, capacity = len(past), 48
    model = _one_layer(TensorProto.FLOAT16, capacity)
    half = lambda *shape: rng.standard_normal(shape).astype(np.float16)  # noqa: E731
    feeds = {
        "q": half(batch, t, HQ * D),
        "k": half(batch, t, HKV * D),
        "v": half(batch, t, HKV * D),
        "past_key_values.0.key": half(batch, HKV, capacity, D),
        "past_key_values.0.value": half(batch, HKV, capacity, D),
        contract.PAST_LENGTH_NAME: np.array([max(past)], np.int64),
        contract.PAST_LENGTHS_NAME: np.array(past, np.int64),
    }
    y, present_k, present_v = run_onnx(model, feeds)

    lower_to_paged(model, BLOCK)
    assert [n.op_type for n in model.graph].count("PagedAttention") == 1
    need = [-(-(p + t) // BLOCK) for p in past]  # blocks each row needs
    num_blocks = sum(need) + 2
    order = rng.permutation(num_blocks)  # rows' blocks scattered over the pool
    table = np.full((batch, max(need) + 1), -1, np.int32)  # -1: unmapped
    for b, count in enumerate(need):
        table[b, :count], order = order[:count], order[count:]
    paged_feeds = {
        **{k: feeds[k] for k in ("q", "k", "v", contract.PAST_LENGTH_NAME)},
        contract.PAST_LENGTHS_NAME: feeds[contract.PAST_LENGTHS_NAME],
        contract.BLOCK_TABLE_NAME: table,
        "key_blocks.0": _to_blocks(feeds["past_key_values.0.key"], past, table, num_blocks),
        "value_blocks.0": _to_blocks(feeds["past_key_values.0.value"], past, table, num_blocks),
    }
    proto = ir.serde.serialize_model(model)
    names = [i.name for i in proto.graph.input]
    evaluator = ReferenceEvaluator(proto, new_ops=[PagedAttention])
    y_paged, key_blocks, value_blocks = evaluator.run(
        None, {n: paged_feeds[n] for n in names if n in paged_feeds}
    )
    np.testing.assert_allclose(y_paged.astype(np.float32), y.astype(np.float32), atol=2e-3)
    for b, p in enumerate(past):
        pos = np.arange(p + t)
        where = table[b, pos // BLOCK], pos % BLOCK
        for pool, present in ((key_blocks, present_k), (value_blocks, present_v)):
            np.testing.assert_array_equal(pool[where], present[b, :, : p + t].transpose(1, 0, 2))


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, shared, reason",
    [
        (TensorProto.FLOAT, True, "PagedAttention takes float16 or bfloat16"),
        (TensorProto.FLOAT16, False, "not a buffer past and present share"),
    ],
)
def test_refused_graph_is_left_unchanged(dtype, shared, reason):
    model = _one_layer(dtype, 16, shared=shared)
    before = ir.serde.serialize_model(model).SerializeToString()
    paging = PagedAttentionPass(BLOCK)
    assert paging(model).modified is False
    assert reason in paging.refused
    assert ir.serde.serialize_model(model).SerializeToString() == before
    with pytest.raises(ValueError, match=reason):
        lower_to_paged(model, BLOCK)


def test_block_size_must_be_a_power_of_two_of_16_or_more():
    for size in (8, 24):
        with pytest.raises(ValueError, match="power of two"):
            PagedAttentionPass(size)
