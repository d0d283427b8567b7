"""A cached step computes only the new tokens' rows of its position machinery.

Before :mod:`tfgraph.passes.cache.slice_machinery`, a relative or ALiBi bias was rebuilt at
(past + new) × (past + new) and sliced to the new rows, O(H·L²) per token (a T5 step went from
0.6 ms at past 128 to 46 ms at past 1016). Now no value of a cached graph has two axes of the
total length, the step's parity holds (prefill and decode against eager PyTorch), and tokens
generated through the cache equal eager greedy decoding."""

import onnx_ir as ir
import onnx_ir.passes.common as common
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tfgraph
from tfgraph import contract, from_module


def total_length_values(path, axes: int = 1) -> list[str]:
    """Values outside the attention kernels with the total length on ``axes`` axes or more."""
    model = ir.load(path)
    common.ShapeInferencePass()(model)
    found = []
    for node in model.graph:
        if node.domain == "com.microsoft":  # the kernels: KV buffers, present outputs
            continue
        for out in node.outputs:
            if out.shape is None:
                continue
            dims = [d.value if isinstance(d, ir.SymbolicDim) else d for d in out.shape]
            if dims.count(contract.TOTAL_DIM) >= axes:
                found.append(f"{node.op_type} {dims}")
    return found


def square_values(path) -> list[str]:
    """The total length on two axes: O(L²) work per step."""
    return total_length_values(path, axes=2)


def _passes(result) -> None:
    parity = result.report["parity"]
    assert result.passed and parity["prefill"]["passed"] and parity["decode"]["passed"]
    assert parity["decode"]["max_abs_err"] < 1e-4


# slow: 16 s per preset; T5's cached generation in tests/e2e stays in the default tier
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["t5-tiny", "bloom-tiny", "mpt-tiny", "shaw-tiny"])
def test_zoo_position_biases_are_computed_for_the_new_rows_only(preset, tmp_path):
    result = tfgraph.export(preset, tmp_path / "a", kv_cache=True)
    _passes(result)
    assert square_values(tmp_path / "a" / "model.onnx") == []


class RelativeBiasLM(nn.Module):
    """A new user's decoder: a learned relative bias from ``arange`` differences (Gather,
    Transpose, Unsqueeze), a ``tril`` mask (Trilu) applied by ``masked_fill`` (Where), the bias
    ``expand``-ed over the batch, and SDPA taking it as ``attn_mask``."""

    def __init__(self, vocab=48, d=16, heads=2, reach=6):
        super().__init__()
        self.heads, self.reach = heads, reach
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.rel = nn.Embedding(2 * reach + 1, heads)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids):
        b, t = input_ids.shape
        x = self.emb(input_ids)
        q, k, v = (
            z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1)
        )
        pos = torch.arange(t, device=input_ids.device)
        rel = (pos[None, :] - pos[:, None]).clamp(-self.reach, self.reach) + self.reach
        bias = self.rel(rel).permute(2, 0, 1)[None]
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        bias = bias.masked_fill(~causal, float("-inf")).expand(b, -1, -1, -1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        y = y.clone(memory_format=torch.contiguous_format)  # torch.onnx's SDPA layout (zoo note)
        return self.head(y.transpose(1, 2).reshape(b, t, -1) + x)


def test_a_hand_written_relative_bias_is_cut_through_every_op(tmp_path):
    torch.manual_seed(0)
    result = tfgraph.export(from_module(RelativeBiasLM().eval()), tmp_path / "a", kv_cache=True)
    _passes(result)
    assert result.report["fusions"]["attention"]["fused"] == 1
    assert square_values(tmp_path / "a" / "model.onnx") == []


@pytest.mark.parametrize("source", ["llama-tiny", "hf-llama"])
def test_rope_tables_are_computed_for_the_new_positions_only(source, tmp_path):
    """RoPE's positions → frequencies (``Mul`` in the zoo, a ``MatMul`` outer product in
    Hugging Face's Llama) → ``Concat`` → ``Cos``/``Sin``: at the new tokens' length (a key
    axis at L, the padding mask's, is legitimate)."""
    if source == "hf-llama":
        transformers = pytest.importorskip("transformers")
        config = transformers.LlamaConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).eval().save_pretrained(tmp_path / "hf")
        source = str(tmp_path / "hf")
    result = tfgraph.export(source, tmp_path / "a", kv_cache=True, row_lengths=False)
    _passes(result)
    found = total_length_values(tmp_path / "a" / "model.onnx")
    assert not [v for v in found if v.split()[0] in ("Cos", "Sin", "MatMul")], found
    if source == "llama-tiny":  # no mask input: nothing outside the kernels spans L
        assert found == []


def save_hf_t5(path, vocab: int = 100, d_model: int = 32, d_kv: int = 8) -> str:
    """A random-init 2 + 2-layer HF T5 with 4 heads saved at ``path``; its path."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=vocab, d_model=d_model, d_ff=2 * d_model, d_kv=d_kv, num_layers=2,
        num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(config).eval().save_pretrained(path)
    return str(path)


# slow: 40 s on HF T5; the zoo position-bias cases stay
@pytest.mark.slow
def test_hugging_face_t5_bias_never_builds_the_square(tmp_path):
    """HF T5 buckets ``Min(rel, zeros_like(rel))``: the ``zeros_like`` is an ``Expand`` to
    ``Shape`` of the (L, L) positions, so its target must come from the cut positions, or the
    whole square is computed just for its shape (1 ms of a 1.8 ms step at past 1016)."""
    result = tfgraph.export(save_hf_t5(tmp_path / "hf"), tmp_path / "a", kv_cache=True)
    _passes(result)
    assert square_values(tmp_path / "a" / "model.onnx") == []
