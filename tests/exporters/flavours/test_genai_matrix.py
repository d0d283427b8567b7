"""``--flavour genai`` across the builder's shapes (issue 46's acceptance): Llama, Qwen2 and
Phi-3 (hidden 256, head size 64, 2 of 4 heads for K/V, 2 layers) in fp32 and int4 (block 32:
MatMulNBits takes its real paths), 32 greedy tokens of ``og.Generator`` equal to tfgraph's
``generate`` for each prompt alone and for a right-padded batch of 2; a sampling run of
both completes; the decoders genai cannot drive are refused with the reason.

Slow: six Hugging Face exports (about 30 s each on a 2-core machine); the default tier keeps
a tiny Llama (test_genai.py).
"""

from __future__ import annotations

import json

import pytest

import tfgraph
from tests.exporters.flavours.test_genai import (
    NEW_TOKENS,
    export_genai,
    genai_generate,
    make_model,
    tfgraph_generate,
)
from tfgraph.errors import TfgraphError

PROMPTS = [[5, 17, 33, 9, 40, 41, 77, 101], [8, 90, 12]]  # no pad id (0) at their ends
WEIGHTS = {"fp32": {}, "int4": {"weights": "int4", "block_size": 32}}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """(arch, weights) → its genai artifact, exported once per module."""
    root = tmp_path_factory.mktemp("genai")
    made = {}

    def get(arch: str, weights: str):
        if (arch, weights) not in made:
            src = root / arch
            if not src.is_dir():
                make_model(src, arch)
            made[arch, weights] = export_genai(src, root / f"{arch}-{weights}", **WEIGHTS[weights])
        return made[arch, weights]

    return get


# slow: six Hugging Face exports (Llama, Qwen2, Phi-3 x fp32, int4), 32 tokens each way
@pytest.mark.slow
@pytest.mark.parametrize("weights", ["fp32", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_genai_greedy_equals_tfgraph(artifacts, arch, weights):
    artifact = artifacts(arch, weights)
    config = json.loads((artifact / "genai_config.json").read_text())
    assert config["model"]["decoder"]["head_size"] == 64
    assert config["search"]["past_present_share_buffer"] is True
    alone = [genai_generate(artifact, [p])[0] for p in PROMPTS]
    assert alone == [tfgraph_generate(artifact, [p])[0] for p in PROMPTS]
    batched = genai_generate(artifact, PROMPTS)  # the second row right-padded by 5
    assert batched == tfgraph_generate(artifact, PROMPTS)  # tfgraph left-pads
    assert batched == alone
    assert sum(map(len, alone)) > NEW_TOKENS  # most tokens compared (not cut short by EOS)
    assert len(set(alone[0])) > 3  # tokens vary: a row read at a wrong length would show


# slow: reuses the Llama int4 export of the matrix
@pytest.mark.slow
def test_genai_sampling_completes(artifacts):
    """Sampling (temperature, top-k, top-p, a seed) runs to the end in both runtimes; genai's
    seeded draws repeat."""
    artifact = artifacts("llama", "int4")
    search = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, random_seed=7)
    first = genai_generate(artifact, PROMPTS, **search)
    assert first == genai_generate(artifact, PROMPTS, **search)
    vocab = json.loads((artifact / "genai_config.json").read_text())["model"]["vocab_size"]
    assert all(0 < len(r) <= NEW_TOKENS and max(r) < vocab for r in first)
    ours = tfgraph_generate(artifact, PROMPTS, do_sample=True, top_k=20, top_p=0.9, seed=7)
    assert all(0 < len(r) <= NEW_TOKENS for r in ours)


# slow: two exports refused after their pipelines
@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "needle"),
    [("t5-tiny", "encoder-decoder"), ("llama-head12", "stays copying")],
)
def test_genai_refuses_decoders_it_cannot_drive(tmp_path, model, needle):
    """An encoder-decoder, and a Llama whose head size (12) is not GroupQueryAttention's:
    one line with the reason, and no artifact left behind."""
    if model == "llama-head12":
        model = str(make_model(tmp_path / "llama", "llama", hidden=48))
    out = tmp_path / "out"
    with pytest.raises(TfgraphError, match=needle) as caught:
        tfgraph.export(model, out, kv_cache=True, flavour="genai")
    assert "\n" not in str(caught.value)
    assert not out.exists()
