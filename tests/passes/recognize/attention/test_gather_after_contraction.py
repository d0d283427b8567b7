"""Relative-key tables are contracted with the queries before their rows are gathered.

Shaw's zoo preset (cached and not) and a hand-written BERT-style ``relative_key`` attention
(``einsum("bhld,lrd->bhlr", q, distance_embedding(l - r))``, as Hugging Face's BERT wrote it
before transformers 5) lose the (L, L, d) gather and keep parity with eager PyTorch; tiny
graphs check the rewrite's numbers (negative indices included) and the cases it leaves alone.
"""

import collections

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common
import pytest
import torch
from ort_run import run_onnx
from pipeline_check import assert_export_passed
from torch import nn

import tfgraph
from tfgraph.passes.recognize.attention.gather_after_contraction import (
    GATHERED_SUFFIX,
    MAX_ROWS,
    GatherAfterContractionPass,
)


def _equations(model: onnx.ModelProto) -> list[str]:
    return [
        onnx.helper.get_attribute_value(a).decode()
        for n in model.graph.node
        if n.op_type == "Einsum"
        for a in n.attribute
        if a.name == "equation"
    ]


# slow (without a cache): 10 s; the cached case runs the same rewrite and the cache besides
@pytest.mark.parametrize("kv_cache", [pytest.param(False, marks=pytest.mark.slow), True])
def test_shaw_contracts_the_table_then_gathers(tmp_path, kv_cache):
    result = tfgraph.export("shaw-tiny", tmp_path / "a", kv_cache=kv_cache)
    assert_export_passed(result, kv_cache)
    model = onnx.load(tmp_path / "a" / "model.onnx")
    ops = collections.Counter(n.op_type for n in model.graph.node)
    # two layers: q·tableᵀ over the 17 table rows (the last label is the new row label)
    equations = _equations(model)
    tables = [e.split("->")[0].split(",")[1] for e in equations]
    assert len(equations) == 2 and all(t[0] not in "ts" for t in tables), equations
    assert ops["GatherND"] == 0, ops  # the (T, L, d) row gather is gone
    gathered = [n for n in model.graph.node if n.output[0].endswith(GATHERED_SUFFIX)]
    assert [n.op_type for n in gathered] == ["Gather", "Gather"], ops  # one per layer


class RelativeKeyEncoder(nn.Module):
    """One BERT-style self-attention with ``relative_key`` scores and an LM head."""

    def __init__(self, vocab=64, d=32, heads=4, max_positions=48):
        super().__init__()
        self.heads, self.max_positions = heads, max_positions
        self.embed = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.distance = nn.Embedding(2 * max_positions - 1, d // heads)
        self.out = nn.Linear(d, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2)  # (B, h, L, L)
        pos = torch.arange(L, device=x.device)
        distance = pos[:, None] - pos[None, :] + self.max_positions - 1  # (L, L)
        rel = self.distance(distance)  # (L, L, hs)
        scores = scores + torch.einsum("bhld,lrd->bhlr", q, rel)
        attn = torch.softmax(scores / (D // self.heads) ** 0.5, dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(B, L, D)
        return self.out(x + y)


def test_bert_style_relative_key_is_rewritten(tmp_path):
    torch.manual_seed(0)
    module = RelativeKeyEncoder()
    source = tfgraph.from_module(module, torch.randint(0, 64, (2, 12)))
    result = tfgraph.export(source, tmp_path / "a")
    assert result.passed, result.report["parity"]["outputs"]
    model = onnx.load(tmp_path / "a" / "model.onnx")
    assert _equations(model) == ["bhld,ad->bhla"]  # 'a': the 95 table rows


def _graph(equation: str, a_shape, table_rows: int, index, gather_nd: bool = False):
    """y = Einsum(equation, a, Gather(table, index)) with a (rows, 3) random table."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((table_rows, 3)).astype(np.float32)
    index = np.asarray(index, np.int64)
    if gather_nd:
        gathered = [onnx.helper.make_node("GatherND", ["table", "index"], ["g"])]
        index = index[..., None]
    else:
        gathered = [onnx.helper.make_node("Gather", ["table", "index"], ["g"], axis=0)]
    nodes = [*gathered, onnx.helper.make_node("Einsum", ["a", "g"], ["y"], equation=equation)]
    graph = onnx.helper.make_graph(
        nodes,
        "g",
        [onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, a_shape)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(a, n) for a, n in ((table, "table"), (index, "index"))],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 20)])
    model = onnx.shape_inference.infer_shapes(model)
    return model, rng.standard_normal(a_shape).astype(np.float32)


def _run(model: onnx.ModelProto, a: np.ndarray) -> np.ndarray:
    return run_onnx(model, {"a": a}, optimize=False)[0]


def _rewrite(model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    ir_model = ir.serde.deserialize_model(model)
    result = GatherAfterContractionPass()(ir_model)
    common.RemoveUnusedNodesPass()(ir_model)  # as the pipeline does after it
    return ir.serde.serialize_model(result.model), result.modified


@pytest.mark.parametrize("gather_nd", [False, True])
def test_rewrite_is_exact_with_negative_indices(gather_nd):
    # index rows hold negative entries (counted from the table's end) and repeats
    index = [[0, -1, 4, 2, -5], [3, 3, -2, 0, 1]]
    model, a = _graph("bud,uvd->buv", [2, 2, 3], 5, index, gather_nd)
    expected = _run(model, a)
    rewritten, modified = _rewrite(model)
    assert modified
    ops = collections.Counter(n.op_type for n in rewritten.graph.node)
    assert ops["Einsum"] == 1 and ops["Gather"] == 1 and ops["GatherND"] == 0, ops
    np.testing.assert_allclose(_run(rewritten, a), expected, rtol=1e-6, atol=1e-6)
    assert not _rewrite(rewritten)[1]  # a second run finds nothing


@pytest.mark.parametrize(
    "equation, a_shape, rows",
    [
        ("bvd,uvd->buv", [2, 5, 3], 5),  # the key label v is also the other operand's
        ("bud,uvd->bvu", [2, 2, 3], 5),  # the output does not end in u v
        ("bud,uvd->buv", [2, 2, 3], MAX_ROWS + 1),  # a table too long to contract whole
    ],
)
def test_other_einsums_are_left_alone(equation, a_shape, rows):
    model, a = _graph(equation, a_shape, rows, np.zeros((2, 5), np.int64))
    rewritten, modified = _rewrite(model)
    assert not modified
    assert [n.op_type for n in rewritten.graph.node] == ["Gather", "Einsum"]
