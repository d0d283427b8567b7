"""``--flavour optimum`` with the real clients (issue 46's acceptance): Optimum's
``ORTModelForCausalLM.generate`` (in its own virtual environment: it pins transformers < 4.58)
and transformers.js in node (``pipeline("text-generation", dir)``, local files) give
tfgraph's greedy tokens for a Llama and a GPT-2 shape, batch 1 and a left-padded batch of 2
(and a Llama with int4 weights in an external data file); and a T5 shape through Optimum's
``ORTModelForSeq2SeqLM`` and transformers.js's ``text2text-generation`` (batch 1 also equal to
eager ``generate``; a padded batch sees its pads in the encoder, in tfgraph as in the clients).

The clients are installed by the session fixture through the documented installer
(``python -m tfgraph.tools.peer_clients``: idempotent, a no-op when they are there), so the
slow tier passes on a fresh machine after the README's set-up (node and npm on PATH, the
package registries reachable).
"""

from __future__ import annotations

import pytest

import tfgraph
from tests.exporters.flavours.test_optimum import (
    EOS,
    NEW_TOKENS,
    PAD,
    PROMPTS,
    eager_tokens,
    make_model,
    make_t5,
    tfgraph_tokens,
)
from tfgraph.errors import TfgraphError
from tfgraph.tools import peer_clients
from tfgraph.tools.peer_run import optimum_generate, transformersjs_generate


@pytest.fixture(scope="session")
def clients():
    """Both clients, installed if missing (minutes the first time: pip and npm)."""
    return peer_clients.install_optimum(), peer_clients.install_transformersjs()


# slow: a second Python environment and node, installed once (minutes) and started per case
@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, options",
    [
        ("llama", {}),
        ("gpt2", {}),
        # int4 weights (MatMulNBits) with the weights in onnx/model.onnx.data
        ("llama", {"weights": "int4", "external_data": True}),
        # standard ONNX (Attention-23, RMSNormalization-23) with a growing past
        ("llama", {"target": "onnx"}),
    ],
    ids=["llama", "gpt2", "llama-int4-external", "llama-onnx-target"],
)
def test_clients_give_tfgraphs_greedy_tokens(arch, options, clients, tmp_path):
    hf_dir = make_model(tmp_path / "hf", arch)
    artifact = tmp_path / "artifact"
    result = tfgraph.export(str(hf_dir), artifact, kv_cache=True, flavour="optimum", **options)
    assert result.passed
    fused = result.report["fusions"]["attention"]
    assert fused["fused"] == fused["total"] == 2
    assert result.report["target"]["name"] == options.get("target", "ort")
    if options.get("external_data"):
        assert (artifact / "onnx" / "model.onnx.data").is_file()
    for batch, prompts in PROMPTS.items():
        want = tfgraph_tokens(artifact, prompts)
        if "weights" not in options:  # fp32: the eager model's own tokens too
            assert want == eager_tokens(hf_dir, prompts), batch
        kwargs = {"eos_token_id": EOS, "pad_token_id": PAD}
        assert optimum_generate(artifact, prompts, NEW_TOKENS, **kwargs) == want, batch
        assert transformersjs_generate(artifact, prompts, NEW_TOKENS, **kwargs) == want, batch
    assert len({t for row in want for t in row}) > 3, want  # the tokens vary


# slow: as above, an encoder-decoder (Optimum's ORTModelForSeq2SeqLM, transformers.js's
# text2text-generation on onnx/encoder_model.onnx + onnx/decoder_model_merged.onnx)
@pytest.mark.slow
def test_clients_give_tfgraphs_greedy_tokens_for_t5(clients, tmp_path):
    hf_dir = make_t5(tmp_path / "hf")
    artifact = tmp_path / "artifact"
    result = tfgraph.export(str(hf_dir), artifact, kv_cache=True, flavour="optimum")
    assert result.passed
    for name in ("encoder_model.onnx", "decoder_model_merged.onnx", "model.onnx", "encoder.onnx"):
        assert (artifact / "onnx" / name).is_file(), name
    kwargs = {"eos_token_id": EOS, "pad_token_id": 0}
    for batch, prompts in PROMPTS.items():
        want = tfgraph_tokens(artifact, prompts)
        if batch == "one":  # a padded batch sees its pads, in tfgraph as in the clients
            assert want == eager_tokens(hf_dir, prompts)
            assert len({t for row in want for t in row}) > 3, want  # the tokens vary
        assert optimum_generate(artifact, prompts, NEW_TOKENS, **kwargs) == want, batch
        assert transformersjs_generate(artifact, prompts, NEW_TOKENS, **kwargs) == want, batch


def test_missing_clients_name_the_install_command(tmp_path):
    for find in (peer_clients.find_optimum, peer_clients.find_transformersjs):
        with pytest.raises(TfgraphError, match="python -m tfgraph.tools.peer_clients") as info:
            find(tmp_path / "nowhere")
        assert "not installed" in str(info.value) and "\n" not in str(info.value)
