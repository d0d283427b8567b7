"""Hugging Face models whose inputs are not token ids (speech features, raw audio, images),
and models whose class name does not say what they return: inputs from ``main_input_name``
and the config, output from a forward pass (:mod:`tfgraph.sources.huggingface`)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from hf_input_models import save
from torch import nn

import tfgraph
from tfgraph.runtime import CachedDecoder, Session
from tfgraph.sources.huggingface import vocabulary
from tfgraph.verify.generation_parity import compare_greedy

transformers = pytest.importorskip("transformers")

# name: (main input, its shape in the manifest, output, attention layers, norms)
CASES = {
    "whisper": ("input_features", ["batch", 16, 32], "logits", 6, 12),
    "speech2text": ("input_features", ["batch", "frames", 16], "logits", 6, 12),
    "vit": ("pixel_values", ["batch", 3, 32, 32], "logits", 2, 5),
    "wav2vec2": ("input_values", ["batch", "samples"], "last_hidden_state", 2, 6),
    "marian": ("input_ids", ["batch", "sequence"], "logits", 6, 10),
    "bart-base": ("input_ids", ["batch", "sequence"], "last_hidden_state", 6, 12),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_inputs")
    for name in CASES:
        save(transformers, name, root / name)
    return root


# slow: speech2text (16 s), marian (13 s: bart-base stays), whisper (12 s: its generation
# below stays in the default tier)
SLOW_INPUTS = ("speech2text", "marian", "whisper")


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_INPUTS else n for n in CASES],
)
def test_inputs_from_the_model(name, hf_dirs, tmp_path):
    main, shape, output, attention, norms = CASES[name]
    result = tfgraph.export(str(hf_dirs / name), tmp_path / "a")
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    inputs = {i["name"]: i for i in manifest["inputs"]}
    assert inputs[main]["shape"] == shape
    assert inputs[main]["dtype"] == ("int64" if main == "input_ids" else "float")
    assert [o["name"] for o in manifest["outputs"]] == [output]
    report = result.report
    assert report["source"]["main_input"] == main
    assert report["parity"]["passed"], report["parity"]["outputs"]
    fusions = report["fusions"]
    assert (fusions["attention"]["fused"], fusions["attention"]["total"]) == (attention,) * 2
    # a weight normalization (wav2vec2's positional conv) counts as a norm-like candidate that
    # no rule folds: it normalizes a weight, not the activations
    weight_norms = [
        m for m in fusions["norm"]["missed"] if ".parametrizations.weight" in m["module"]
    ]
    assert len(weight_norms) == (name == "wav2vec2")
    assert (fusions["norm"]["fused"], fusions["norm"]["total"]) == (
        norms,
        norms + len(weight_norms),
    )


def test_speech_encoder_decoder_generates_like_eager(hf_dirs, tmp_path):
    """Whisper with --kv-cache: the encoder reads the features once, and 16 greedy tokens per
    row equal eager full recompute, token for token."""
    result = tfgraph.export(str(hf_dirs / "whisper"), tmp_path / "a", kv_cache=True)
    parity = result.report["parity"]
    assert parity["prefill"]["passed"] and parity["decode"]["passed"]
    assert (tmp_path / "a" / "encoder.onnx").is_file()
    decoder = CachedDecoder(Session(tmp_path / "a"))
    assert decoder.seq2seq and decoder.encoder_inputs == ["input_features"]
    features = np.random.default_rng(0).standard_normal((2, 16, 32)).astype(np.float32)
    source = tfgraph.load_source(str(hf_dirs / "whisper"))
    comparison = compare_greedy(source, decoder, [[0], [0]], 16, extra={"input_features": features})
    assert comparison.passed, comparison.steps
    assert comparison.tokens[0] != comparison.tokens[1]  # the rows heard different features

    # the CLI: features from an .npz, one line per row
    np.savez(tmp_path / "f.npz", input_features=features)
    cli = [sys.executable, "-m", "tfgraph", "generate", str(tmp_path / "a")]
    done = subprocess.run(
        [*cli, "--inputs", str(tmp_path / "f.npz"), "--max-new-tokens", "16"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    rows = [line.split("] ", 1)[1].split() for line in done.stdout.splitlines()]
    assert [[int(t) for t in r] for r in rows] == comparison.tokens
    np.savez(tmp_path / "bad.npz", input_features=features[0])
    bad = subprocess.run(
        [*cli, "--inputs", str(tmp_path / "bad.npz")], capture_output=True, text=True
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: --inputs 'input_features' has rank 2; the model takes ['batch', 16, 32]"
    ]


def test_vocabulary_unknown_is_a_clean_error():
    class NoEmbedding(nn.Module):
        config = type("Config", (), {})()

        def forward(self, input_ids):
            return input_ids.float()

    with pytest.raises(tfgraph.TfgraphError, match="no vocab_size.*add vocab_size"):
        vocabulary(NoEmbedding(), NoEmbedding.config)
    embedded = nn.Module()
    embedded.get_input_embeddings = lambda: nn.Embedding(77, 4)
    assert vocabulary(embedded, NoEmbedding.config) == 77  # the embedding wins over the config


def test_run_takes_non_token_inputs(hf_dirs, tmp_path):
    tfgraph.export(str(hf_dirs / "vit"), tmp_path / "a")
    pixels = torch.randn(1, 3, 32, 32).numpy()
    np.savez(tmp_path / "p.npz", pixel_values=pixels)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfgraph",
            "run",
            str(tmp_path / "a"),
            "--inputs",
            str(tmp_path / "p.npz"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "(1, 5)" in done.stdout  # logits over 5 labels
