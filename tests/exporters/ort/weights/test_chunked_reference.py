"""The streamed reference computes a huge quantized head and embedding table in pieces
(tfgraph.exporters.ort.weights.chunked_reference): BLOOM's 250k-word vocabulary is 4.1 GB in
fp32 each.
Here the threshold is lowered so a tiny tied BLOOM takes that path, and the export's parity
(prefill, decode, rows) must still pass against it."""

import pytest
import torch

import tfgraph
import tfgraph.exporters.ort.weights.chunked_reference as chunked_reference
from tfgraph.sources import in_pieces


@pytest.fixture(scope="module")
def bloom_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("bloom") / "ck"
    config = transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=3000)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        transformers.BloomForCausalLM(config).eval().save_pretrained(path)
    return path


def test_huge_head_and_table_in_pieces_pass_parity(bloom_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(in_pieces, "LARGE", 1000)
    monkeypatch.setattr(in_pieces, "ROWS", 700)  # the last block is short
    swapped = []
    swap = chunked_reference.swap_large
    import tfgraph.exporters.ort.weights.streamed_reference as streamed_reference

    def recorded(*args):
        swapped.extend(swap(*args))
        return swapped

    monkeypatch.setattr(streamed_reference, "swap_large", recorded)
    result = tfgraph.export(str(bloom_dir), tmp_path / "a", kv_cache=True, weights="int4")
    parity = result.report["parity"]
    assert sorted(swapped) == ["lm_head.weight", "transformer.word_embeddings.weight"]
    assert result.passed and parity["rows"]["passed"], parity
    assert parity["prefill"]["passed"] and parity["decode"]["passed"]


def test_row_embedding_equals_the_whole_table(bloom_dir, tmp_path):
    import numpy as np
    import onnx_ir as ir

    from tfgraph.exporters.ort.weights.gather_nbits import dequantize_table

    out = tmp_path / "a"
    tfgraph.export(str(bloom_dir), out, weights="int4", external_data=True)
    model = ir.load(out / "model.onnx")
    node = next(n for n in model.graph if n.op_type == "GatherBlockQuantized")
    table = model.graph.initializers[node.inputs[0].name].const_value
    assert isinstance(table, ir.ExternalTensor)  # the stored-bytes path
    ids = torch.tensor([[5, 0, 2999], [5, 17, 1]])
    reader = chunked_reference._table_reader(node, model.graph.initializers)
    embed = in_pieces.RowEmbedding(reader, (3000, 64))
    whole = dequantize_table(node, model.graph.initializers)
    np.testing.assert_array_equal(embed(ids).numpy(), whole[ids.numpy()])


def test_the_fp32_streamed_model_reads_huge_weights_in_pieces(bloom_dir, monkeypatch):
    """The streamed fp32 reference (the checkpoint's own rows, never the whole table) gives
    the logits of the model loaded whole."""
    import transformers

    from tfgraph.sources import load_source

    monkeypatch.setattr(in_pieces, "LARGE", 1000)
    monkeypatch.setattr(in_pieces, "ROWS", 700)
    source = load_source(str(bloom_dir))
    model = source.module.model
    assert isinstance(model.lm_head, in_pieces.ChunkedHead)
    assert isinstance(model.transformer.word_embeddings, in_pieces.RowEmbedding)
    inputs = source.inputs(2, 9)
    got = source.eager(inputs)["logits"]
    whole = transformers.BloomForCausalLM.from_pretrained(bloom_dir).eval()
    with torch.no_grad():
        want = whole(**inputs).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
