"""``tfgraph.load(dir)``: an artifact opened for generation from Python — text or ids in, the
same kind out, batches, sampling, EOS, the manifest and tokenizer, and one-line errors."""

import json
import subprocess
import sys

import numpy as np
import pytest
from tiny_text import word_tokenizer

import tfgraph
from tfgraph.errors import TfgraphError
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, generate


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """gpt-tiny (a preset, 256 tokens) with the WordLevel tokenizer carried in, KV-cached."""
    out = tmp_path_factory.mktemp("loaded") / "gpt"
    tfgraph.export("gpt-tiny", out, tokenizer=word_tokenizer(), kv_cache=True)
    return out


def _reference(path, prompts, **config):
    """The runtime's own generate on the same artifact: what load() must wrap, unchanged."""
    decoder = CachedDecoder(Session(path))
    return generate(decoder, prompts, GenerationConfig(**config)).tokens


def test_text_and_ids(artifact):
    llm = tfgraph.load(artifact)
    ids = llm.tokenizer("w4 w9 w200")["input_ids"]
    assert ids == [7, 12, 203]
    expected = _reference(artifact, [ids], max_new_tokens=6, eos_token_id=2, pad_token_id=2)[0]
    assert llm.generate(ids, max_new_tokens=6) == expected  # ids in → ids out
    assert llm.generate(np.array(ids), max_new_tokens=6) == expected  # an array of ids too
    assert llm.generate(llm.tokenizer("w4 w9 w200"), max_new_tokens=6) == expected
    text = llm.generate("w4 w9 w200", max_new_tokens=6)  # text in → the new text
    assert text == llm.tokenizer.decode(expected, skip_special_tokens=True)


def test_batches(artifact):
    llm = tfgraph.load(artifact)
    prompts = [[7, 12, 203], [40, 41, 42]]
    expected = _reference(artifact, prompts, max_new_tokens=5, eos_token_id=2, pad_token_id=2)
    assert llm.generate(prompts, max_new_tokens=5) == expected
    texts = llm.generate(["w4 w9 w200", "w37 w38 w39"], max_new_tokens=5)
    assert texts == [llm.tokenizer.decode(t, skip_special_tokens=True) for t in expected]


def test_sampling_and_eos(artifact):
    llm = tfgraph.load(artifact)
    sampled = llm.generate([7, 12], max_new_tokens=8, do_sample=True, top_k=20, seed=3)
    assert sampled == llm.generate([7, 12], max_new_tokens=8, do_sample=True, top_k=20, seed=3)
    expected = _reference(
        artifact, [[7, 12]], max_new_tokens=8, do_sample=True, top_k=20, seed=3, eos_token_id=2
    )[0]
    assert sampled == expected
    first = llm.generate([7, 12], max_new_tokens=1, ignore_eos=True)[0]
    assert llm.generate([7, 12], max_new_tokens=8, eos_token_id=first) == [first]
    assert len(llm.generate([7, 12], max_new_tokens=8, ignore_eos=True)) == 8


def test_manifest_tokenizer_and_names(artifact):
    llm = tfgraph.load(artifact)
    assert llm.manifest == json.loads((artifact / "manifest.json").read_text())
    assert llm.manifest["kv_cache"] and "tokenizer/tokenizer.json" in llm.manifest["files"]
    assert llm.tokenizer.eos_token == "</s>"
    assert "preset:gpt-tiny" in repr(llm)
    for name in ("export", "load", "LoadedModel", "ExportOptions", "from_module"):
        assert name in dir(tfgraph)


def test_generating_without_torch(artifact, tmp_path):
    """Three lines from a notebook, token ids in and out, import no torch (text needs
    transformers, which imports torch itself)."""
    bare = tmp_path / "bare"  # the artifact without its tokenizer
    bare.mkdir()
    for f in ("model.onnx", "manifest.json"):
        (bare / f).write_bytes((artifact / f).read_bytes())
    code = (
        "import sys, tfgraph\n"
        f"print(tfgraph.load({str(bare)!r}).generate([7, 12], max_new_tokens=3))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == _reference(bare, [[7, 12]], max_new_tokens=3)[0]


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        ({"ids": [1]}, "prompt: a text, a list of token ids"),
        ([], "prompt: a text, a list of token ids"),
        ([[1, 2], "w1"], "prompt: a text, a list of token ids"),
    ],
)
def test_bad_prompts(artifact, prompt, needle):
    with pytest.raises(TfgraphError, match=needle):
        tfgraph.load(artifact).generate(prompt)


def test_errors(gpt_artifact, tmp_path):
    plain = tfgraph.load(gpt_artifact.out_dir)  # exported without kv_cache: loads, cannot generate
    assert plain.tokenizer is None and plain.manifest["kv_cache"] is False
    with pytest.raises(TfgraphError, match="carries no tokenizer: give token ids"):
        plain.generate("w1 w2")
    with pytest.raises(TfgraphError, match="export it with --kv-cache"):
        plain.generate([1, 2])
    with pytest.raises(TfgraphError, match="no artifact directory"):
        tfgraph.load(tmp_path / "missing")
