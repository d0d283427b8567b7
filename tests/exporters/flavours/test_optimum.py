"""``--flavour optimum`` (issue 46): the files, I/O contract and fusion of an export that
Optimum's ``ORTModelForCausalLM`` and transformers.js load, and tfgraph's own runtime on it.

Default tier: one tiny random-init Llama directory with a WordLevel tokenizer (written here),
exported once; its layout (``onnx/model.onnx``, ``config.json``, ``generation_config.json``,
tokenizer files at the root), Optimum's input/output names and order, the ``batch_size`` dim
transformers.js resolves, GroupQueryAttention in every layer, and tfgraph's greedy tokens
(batch 1 and a left-padded batch of 2) equal to eager ``generate``; the refusals; and a tiny
T5: the clients' encoder_model.onnx / decoder_model_merged.onnx pair beside tfgraph's, its
names and its cross K/V cache (projected once, handed through after). The real
clients (Optimum in its own environment, transformers.js in node) are in
test_optimum_clients.py, slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import tfgraph
from tfgraph.errors import TfgraphError
from tfgraph.options import ExportOptions
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, generate
from tfgraph.runtime.generate import seq2seq_prompts
from tfgraph.tools.peer_run import left_padded, until_eos

transformers = pytest.importorskip("transformers")

EOS, PAD = 2, 2
NEW_TOKENS = 16
PROMPTS = {"one": [[1, 5, 6, 7, 8, 9]], "padded": [[1, 5, 6, 7, 8, 9], [1, 40, 41]]}
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]


def write_tokenizer(path: Path) -> None:
    """A WordLevel tokenizer over ``WORDS`` (ids = positions), saved as transformers does."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="</s>",
    )  # fmt: skip
    fast.save_pretrained(path)


def make_model(path: Path, arch: str) -> Path:
    """A random-init 2-layer ``arch`` (llama: 4 heads over 2 KV heads; gpt2) with the
    tokenizer, vocabulary 256, weights drawn wide so that greedy tokens vary; seeded."""
    common = {"vocab_size": len(WORDS), "bos_token_id": 1, "eos_token_id": EOS}
    if arch == "llama":
        config = transformers.LlamaConfig(
            **common, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.2,
        )  # fmt: skip
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.GPT2Config(
            **common, n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.2
        )
        cls = transformers.GPT2LMHeadModel
    with torch.random.fork_rng():
        torch.manual_seed(0)
        cls(config).eval().save_pretrained(path)
    write_tokenizer(path)
    return path


def make_t5(path: Path) -> Path:
    """A random-init 2-layer T5 with the tokenizer (``initializer_factor`` 2: greedy tokens
    vary; the default repeats one token); seeded."""
    config = transformers.T5Config(
        vocab_size=len(WORDS), d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=EOS, initializer_factor=2.0,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        transformers.T5ForConditionalGeneration(config).eval().save_pretrained(path)
    write_tokenizer(path)
    return path


def eager_tokens(hf_dir: Path, prompts) -> list[list[int]]:
    """Hugging Face ``generate``'s greedy new tokens on the left-padded prompts, cut at EOS."""
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    seq2seq = config.is_encoder_decoder
    auto = transformers.AutoModelForSeq2SeqLM if seq2seq else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(hf_dir).eval()
    pad = config.pad_token_id if seq2seq else PAD
    ids, mask = left_padded(prompts, pad)
    with torch.no_grad():
        out = model.generate(
            torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=NEW_TOKENS,
            do_sample=False, num_beams=1, eos_token_id=EOS, pad_token_id=pad,
        )  # fmt: skip
    return until_eos(out[:, 1 if seq2seq else len(ids[0]) :].tolist(), EOS)


def tfgraph_tokens(artifact: Path, prompts) -> list[list[int]]:
    """tfgraph's runtime: greedy new tokens, cut at EOS (an encoder-decoder's prompts feed
    its encoder; its decoder starts from ``decoder_start_token_id``)."""
    decoder = CachedDecoder(Session(artifact))
    config = json.loads((artifact / "config.json").read_text())
    extra, pad = None, PAD
    if config.get("is_encoder_decoder"):
        pad = config["pad_token_id"]
        prompts, extra = seq2seq_prompts(decoder, prompts, pad, config["decoder_start_token_id"])
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=EOS, pad_token_id=pad)
    return until_eos(generate(decoder, prompts, generation, extra=extra).tokens, EOS)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("optimum")
    hf_dir = make_model(root / "hf", "llama")
    result = tfgraph.export(str(hf_dir), root / "artifact", kv_cache=True, flavour="optimum")
    return hf_dir, root / "artifact", result


def test_files_at_the_clients_places(llama):
    hf_dir, artifact, result = llama
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["flavour"] == "optimum"
    assert manifest["files"][0] == "onnx/model.onnx"  # tfgraph's runtime opens the first
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "onnx/model.onnx"):  # fmt: skip
        assert (artifact / name).is_file(), name
        assert name in manifest["files"]
    assert not (artifact / "model.onnx").exists()
    config = json.loads((artifact / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2
    assert config["use_cache"] is True
    assert config["transformers.js_config"]["dtype"] == "fp32"  # names onnx/model.onnx
    assert json.loads((artifact / "generation_config.json").read_text())["eos_token_id"] == EOS
    assert (artifact / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    assert result.passed


def _dims(value) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_optimum_io_contract_still_fused(llama):
    _, artifact, result = llama
    model = onnx.load(artifact / "onnx" / "model.onnx")
    graph = model.graph
    kv = [f"past_key_values.{i}.{kind}" for i in range(2) for kind in ("key", "value")]
    assert [v.name for v in graph.input] == ["input_ids", "attention_mask", *kv]
    presents = [f"present.{i}.{kind}" for i in range(2) for kind in ("key", "value")]
    assert [v.name for v in graph.output] == ["logits", *presents]
    # transformers.js sizes the empty past from these: batch_size resolved, the rest 0
    assert _dims(graph.input[2]) == ["batch_size", 2, "past_sequence", 16]
    assert _dims(graph.output[1]) == ["batch_size", 2, "total_sequence", 16]
    assert _dims(graph.input[0])[0] == "batch_size"
    ops = [n.op_type for n in graph.node]
    assert ops.count("GroupQueryAttention") == 2  # fused, past and present apart (concat)
    gqa = next(n for n in graph.node if n.op_type == "GroupQueryAttention")
    assert gqa.input[3] == "past_key_values.0.key" and gqa.output[1] == "present.0.key"
    fused = result.report["fusions"]["attention"]
    assert fused["fused"] == fused["total"] == 2
    layout = json.loads((artifact / "manifest.json").read_text())["kv_layout"]
    assert layout["kind"] == "concat"
    assert layout["present_extends_past"]["present.1.value"] == "past_key_values.1.value"


@pytest.mark.parametrize("batch", PROMPTS)
def test_tfgraph_greedy_tokens_equal_eager(llama, batch):
    hf_dir, artifact, _ = llama
    got = tfgraph_tokens(artifact, PROMPTS[batch])
    assert got == eager_tokens(hf_dir, PROMPTS[batch])
    assert len({t for row in got for t in row}) > 3, got  # the tokens vary


def test_session_opens_the_step_graph_in_its_folder(llama):
    _, artifact, _ = llama
    by_dir, by_file = Session(artifact), Session(artifact / "onnx" / "model.onnx")
    assert by_dir.path == by_file.path == artifact / "onnx" / "model.onnx"
    assert by_file.manifest is not None  # the manifest one folder up names it
    assert by_dir.signature == by_file.signature
    assert not by_dir.signature.shared_buffer  # the growing past
    ids = np.array([[1, 5, 6]], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    feeds.update({f"past_key_values.{i}.{k}": np.zeros((1, 2, 0, 16), np.float32)
                  for i in range(2) for k in ("key", "value")})  # fmt: skip
    out = by_dir.run(feeds)
    assert out["present.1.key"].shape == (1, 2, 3, 16)


def test_servers_refuse_the_growing_cache_with_what_to_do(llama):
    """In-flight batching (``tfgraph serve``) and Triton's repository need per-row past
    lengths: the optimum layout is refused in one line that names the flavours that serve."""
    from tfgraph.runtime.inflight import inflight_support
    from tfgraph.runtime.serving.repository import read_artifact

    _, artifact, _ = llama
    why = inflight_support(CachedDecoder(Session(artifact)))
    assert why is not None and "--flavour optimum" in why and "--flavour genai" in why, why
    with pytest.raises(TfgraphError, match="laid out for Optimum") as info:
        read_artifact(artifact)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "needs --kv-cache"),
        ({"kv_cache": True, "target": "tensorrt"}, "--target ort or ort-cuda or onnx"),
        ({"kv_cache": True, "kv_dtype": "int8"}, "drop --kv-dtype int8"),
    ],
)
def test_options_it_cannot_lay_out(fields, message):
    with pytest.raises(TfgraphError, match=message):
        ExportOptions(flavour="optimum", **fields).resolved()


def test_a_source_without_a_hf_config_is_refused(tmp_path, no_trace):
    """One line, before the trace (which would take the time of a whole export)."""
    with pytest.raises(TfgraphError, match="needs a Hugging Face model") as info:
        tfgraph.export("gpt-tiny", tmp_path / "out", kv_cache=True, flavour="optimum")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_a_graph_saved_in_a_folder_finds_its_external_data(tmp_path):
    """save_onnx with ``onnx/model.onnx``: the data file lies beside the model and is named
    relative to it, as ONNX Runtime (and the clients) resolve it."""
    import onnx_ir as ir
    import onnxruntime as ort

    from tfgraph.exporters import save_onnx

    weight = ir.tensor(np.arange(256, dtype=np.float32).reshape(16, 16), name="w")
    x = ir.Value(name="x", shape=ir.Shape([1, 16]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(name="w", const_value=weight, shape=weight.shape, type=ir.TensorType(weight.dtype))
    node = ir.node("MatMul", [x, w], outputs=[ir.Value(name="y")])
    node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[w], opset_imports={"": 20})
    model = ir.Model(graph, ir_version=10)
    files = save_onnx(model, tmp_path, external_data=True, name="onnx/model.onnx")
    assert files == ["onnx/model.onnx", "onnx/model.onnx.data"]
    saved = onnx.load(tmp_path / "onnx" / "model.onnx", load_external_data=False)
    assert saved.graph.initializer[0].external_data[0].value == "model.onnx.data"
    session = ort.InferenceSession(tmp_path / "onnx" / "model.onnx")
    x_in = np.ones((1, 16), np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x_in})[0], x_in @ weight.numpy())


# slow: 25 s (a T5 export); the clients run the pair in the slow tier too
@pytest.mark.slow
def test_an_encoder_decoder_gets_the_clients_pair(tmp_path):
    """T5: tfgraph's own pair (its runtime) and Optimum's encoder_model.onnx +
    decoder_model_merged.onnx beside it; the merged decoder projects the cross K/V at the first
    step (empty encoder past) and hands the fed-back pasts through after."""
    import onnxruntime as ort

    hf_dir = make_t5(tmp_path / "hf")
    artifact = tmp_path / "artifact"
    assert tfgraph.export(str(hf_dir), artifact, kv_cache=True, flavour="optimum").passed
    prompts = PROMPTS["one"]
    assert tfgraph_tokens(artifact, prompts) == eager_tokens(hf_dir, prompts)
    encoder = ort.InferenceSession(artifact / "onnx" / "encoder_model.onnx")
    assert [v.name for v in encoder.get_outputs()] == ["last_hidden_state"]
    decoder = ort.InferenceSession(artifact / "onnx" / "decoder_model_merged.onnx")
    kv = [f"{i}.{side}.{k}" for i in range(2) for side in ("decoder", "encoder")
          for k in ("key", "value")]  # fmt: skip
    assert [v.name for v in decoder.get_inputs()] == [
        "input_ids", "encoder_hidden_states", *(f"past_key_values.{n}" for n in kv)
    ]  # fmt: skip
    assert [v.name for v in decoder.get_outputs()] == ["logits", *(f"present.{n}" for n in kv)]
    hidden = encoder.run(None, {"input_ids": np.array(prompts, np.int64)})[0]
    feeds = {"input_ids": np.zeros((1, 1), np.int64), "encoder_hidden_states": hidden}
    feeds.update({f"past_key_values.{n}": np.zeros((1, 4, 0, 16), np.float32) for n in kv})
    names = [o.name for o in decoder.get_outputs()]
    first = dict(zip(names, decoder.run(None, feeds), strict=True))
    assert first["present.1.encoder.value"].shape == (1, 4, len(prompts[0]), 16)
    fed_back = {f"past_key_values.{n}": first[f"present.{n}"] for n in kv}
    fed_back["past_key_values.0.encoder.key"] = np.full((1, 4, 6, 16), 7.0, np.float32)
    second = decoder.run(["present.0.encoder.key"], {**feeds, **fed_back})[0]
    assert (second == 7.0).all()  # handed through, not projected again
