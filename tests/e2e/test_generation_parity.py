"""KV-cached generation against eager PyTorch full recompute, for every decoder and
encoder-decoder preset and for Hugging Face GPT-2, Llama, Mistral, BLOOM, T5 and BART built from
configs: ``export --kv-cache`` (with its own prefill + decode parity), then greedy generation of
32 new tokens for a batch of 2 prompts of different lengths (left-padded), token for token,
and every step's logits within the fp32 parity tolerance."""

import numpy as np
import onnx
import pytest
import torch
from idiom_models import LeftPaddedInputs

import tfgraph
from tests.e2e.test_hf_pipelines import CONFIGS, SMALL
from tfgraph.models.presets import PRESETS
from tfgraph.runtime import CachedDecoder, Session
from tfgraph.runtime.generate import left_pad
from tfgraph.sources import load_source
from tfgraph.verify.generation_parity import compare_greedy

NEW_TOKENS = 32
PAD = 0
PRESET_CASES = [n for n, cfg in PRESETS.items() if cfg.family in ("decoder", "encoder-decoder")]
HF_CASES = ["gpt2", "llama", "mistral", "bloom", "t5", "bart"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf_gen")
    paths = {}
    for name in HF_CASES:
        cls, cfg, kwargs = CONFIGS[name]
        config = getattr(transformers, cfg)(**{**SMALL, **kwargs})
        torch.manual_seed(0)
        getattr(transformers, cls)(config).eval().save_pretrained(root / name)
        paths[name] = root / name
    return paths


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 200, 6).tolist(), rng.integers(1, 200, 3).tolist()]


def _check(source, tmp_path, target: str = "ort") -> None:
    result = tfgraph.export(source, tmp_path / "artifact", kv_cache=True, target=target)
    report = result.report
    assert report["kv_cache"] is True
    if target != "ort":  # the static, standard cache: TensorScatter into shared buffers
        assert result.manifest["kv_layout"]["kind"] == "static"
        ops = [n.op_type for n in onnx.load(tmp_path / "artifact" / "model.onnx").graph.node]
        layers = result.manifest["kv_layout"]["layers"]
        assert ops.count("TensorScatter") == 2 * layers
    parity = report["parity"]
    assert parity["prefill"]["passed"] and parity["decode"]["passed"], parity["outputs"]
    assert report["fusions"]["attention"]["fused"] == report["fusions"]["attention"]["total"]

    decoder = CachedDecoder(Session(tmp_path / "artifact"))
    prompts = _prompts(seed=len(source.origin))
    extra: dict[str, np.ndarray] = {}
    if decoder.token_input == "decoder_input_ids":  # prompts feed the encoder
        ids, mask = left_pad([p + [7] for p in prompts], PAD)
        extra = {"input_ids": ids, "attention_mask": mask}
        gen_prompts = [[0], [0]]
    else:
        gen_prompts = prompts
    comparison = compare_greedy(source, decoder, gen_prompts, NEW_TOKENS, extra=extra, pad=PAD)
    for step, row in enumerate(comparison.steps):
        assert row["passed"], (step, row)
    assert comparison.tokens == comparison.want_tokens


class MaskedLM(LeftPaddedInputs, torch.nn.Module):
    """HF GPT-2 taking ``attention_mask``: left padding is masked (in the cache too)."""

    vocab = 200

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def _source(case: str, hf_dirs):
    kind, name = case.split(":")
    if kind == "preset":
        return load_source(name)
    if kind == "masked":
        model = transformers_model(hf_dirs[name])
        return tfgraph.from_module(MaskedLM(model), origin=f"masked:{name}")
    # the library's default attention (sdpa), except T5 whose sdpa does not trace with dynamic
    # shapes in transformers 5 (a string MODEL falls back to eager by itself)
    return load_source(str(hf_dirs[name]), attn_implementation="eager" if name == "t5" else None)


def transformers_model(path):
    import transformers

    return transformers.GPT2LMHeadModel.from_pretrained(path).eval()


CASES = [f"preset:{n}" for n in PRESET_CASES] + [f"hf:{n}" for n in HF_CASES] + ["masked:gpt2"]


# slow: every preset and HF architecture generating through the cache on ort
@pytest.mark.parametrize(
    "case",
    [
        c
        # t5-tiny slow (17 s): its cached requests equal generate in test_inflight
        if c in ("preset:llama-tiny", "hf:gpt2", "masked:gpt2")
        else pytest.param(c, marks=pytest.mark.slow)
        for c in CASES
    ],
)
def test_cached_generation(case, hf_dirs, tmp_path):
    _check(_source(case, hf_dirs), tmp_path)


def test_bidirectional_model_is_refused_with_the_layer_and_reason(tmp_path):
    """An encoder's attention is not causal: new tokens would change the earlier ones."""
    with pytest.raises(tfgraph.TfgraphError, match=r"cannot insert a KV cache: .*not causal"):
        tfgraph.export("bert-tiny", tmp_path / "a", kv_cache=True)
    assert not (tmp_path / "a").exists()


# slow: every preset generating through the static cache on onnx
@pytest.mark.parametrize(
    "preset",
    [
        p if p == "gpt2-tiny" else pytest.param(p, marks=pytest.mark.slow)  # t5-tiny: 13 s
        for p in PRESET_CASES
    ],
)
def test_static_cache_generation_on_the_onnx_target(preset, tmp_path):
    """Every zoo decoder and encoder-decoder with the static standard-ONNX cache (opset 24
    TensorScatter, Attention reading the whole buffer), run by ONNX Runtime."""
    _check(load_source(preset), tmp_path, target="onnx")


# slow: the static cache on tensorrt's graph for four presets; llama-tiny stays
@pytest.mark.parametrize(
    "preset",
    [
        pytest.param("gpt2-tiny", marks=pytest.mark.slow),
        "llama-tiny",
        pytest.param("bloom-tiny", marks=pytest.mark.slow),
        pytest.param("t5-tiny", marks=pytest.mark.slow),
    ],
)
def test_static_cache_generation_on_the_tensorrt_target(preset, tmp_path):
    """The tensorrt target's decomposed attention over the static cache (run here by ONNX
    Runtime; TensorRT itself is not on these machines)."""
    _check(load_source(preset), tmp_path, target="tensorrt")


def test_forced_agreement_judges_each_step_on_the_engines_prefix(tmp_path):
    """One eager pass over the engine's own tokens: an honest engine agrees at every step;
    tokens that are not what the engine's logits chose (a stand-in for a wrong engine) are
    unexplained, since the eager logits on that prefix are far from the engine's."""
    from tfgraph.verify.generation_parity import forced_agreement

    tfgraph.export("llama-tiny", tmp_path / "a", kv_cache=True)
    source = load_source("llama-tiny")
    decoder = CachedDecoder(Session(tmp_path / "a"))
    prompts = [[5, 9, 2, 7, 11, 3], [4, 8, 1, 6, 10, 12]]
    found = compare_greedy(source, decoder, prompts, 12)
    forced = forced_agreement(source, decoder, prompts, found.tokens, found.engine_logits, 1e-3)
    assert (forced["steps"], forced["rows"]) == (12, 2)
    assert forced["equal"] == 24 and forced["unexplained"] == 0
    assert forced["max_logits_diff"] < 1e-4
    shifted = [[(t + 1) % 256 for t in row] for row in found.tokens]
    wrong = forced_agreement(source, decoder, prompts, shifted, found.engine_logits, 1e-3)
    assert wrong["equal"] == 0 and wrong["unexplained"] == 24
