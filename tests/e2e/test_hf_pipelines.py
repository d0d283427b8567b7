"""Hugging Face models built from configs (random init, nothing downloaded), saved with
``save_pretrained`` and loaded as a user would: every target folds every norm, with parity."""

import pytest
from pipeline_check import compile_and_prove

from tfgraph import load_source
from tfgraph.sources.trace import trace

transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": 500}
CONFIGS = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {"n_layer": 2, "n_embd": 64, "n_head": 4}),
    "bert": (
        "BertModel",
        "BertConfig",
        {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "intermediate_size": 128,
        },
    ),
    "llama": (
        "LlamaForCausalLM",
        "LlamaConfig",
        {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
        },
    ),
    "t5": (
        "T5ForConditionalGeneration",
        "T5Config",
        {"num_layers": 2, "d_model": 64, "num_heads": 4, "d_kv": 16, "d_ff": 128},
    ),
    "bart": (
        "BartForConditionalGeneration",
        "BartConfig",
        {
            "encoder_layers": 2,
            "decoder_layers": 2,
            "d_model": 64,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128,
        },
    ),
    "bloom": ("BloomForCausalLM", "BloomConfig", {"n_layer": 2, "hidden_size": 64, "n_head": 4}),
    "mistral": (
        "MistralForCausalLM",
        "MistralConfig",
        {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "sliding_window": 4,
        },
    ),
    # a hybrid: one Gated DeltaNet layer (causal conv + gated delta rule), one gated attention
    "qwen3_next": (
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        {
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 128,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
        },
    ),
    # recurrent only: Mamba-1 (causal conv + per-channel selective scan)
    "mamba": (
        "MambaForCausalLM",
        "MambaConfig",
        {"num_hidden_layers": 2, "hidden_size": 64, "state_size": 16, "time_step_rank": 8},
    ),
}
# Norms each model has: per layer, plus embedding/final norms.
NORMS = {"gpt2": 5, "bert": 5, "llama": 5, "t5": 12, "bart": 12, "bloom": 6, "mistral": 5}
# Qwen3-Next: 8 RMSNorms, and its gated delta net's L2-normalized q/k (issue 47)
NORMS.update(qwen3_next=10, mamba=3)
ATTENTION = {"gpt2": 2, "bert": 2, "llama": 2, "t5": 6, "bart": 6, "bloom": 2, "mistral": 2}
ATTENTION.update(qwen3_next=1, mamba=0)
# convolutions + recurrences traced as canonical ops: kernels on ort, a Scan and a Conv elsewhere
RECURRENT = {"qwen3_next": 2, "mamba": 4}
# (model, attn_implementation): eager everywhere, and the library default (sdpa) where it
# traces; T5's sdpa does not trace with dynamic shapes in transformers 5 (export falls back).
CASES = [(name, "eager") for name in CONFIGS] + [
    (name, "sdpa") for name in ("gpt2", "llama", "mistral", "bert", "bart")
]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_models")
    paths = {}
    for name, (cls, cfg, kwargs) in CONFIGS.items():
        config = getattr(transformers, cfg)(**{**SMALL, **kwargs})
        getattr(transformers, cls)(config).eval().save_pretrained(root / name)
        paths[name] = root / name
    return paths


# slow: HF architectures x attention implementations x targets; gpt2 (eager) stays in the
# default tier (the zoo's t5-tiny and the recurrent-state tests cover an encoder-decoder and
# recurrent layers there)
@pytest.mark.parametrize(
    ("name", "attn"),
    [c if c == ("gpt2", "eager") else pytest.param(*c, marks=pytest.mark.slow) for c in CASES],
)
def test_hf_model_all_targets(name, attn, hf_dirs, tmp_path):
    source = load_source(str(hf_dirs[name]), attn_implementation=attn)
    for opset, targets in ((20, ("ort",)), (23, ("onnx", "tensorrt"))):
        traced = trace(source, opset=opset)
        for target in targets:
            result = compile_and_prove(source, traced, "default", target, tmp_path)
            assert result["parity"]["passed"], (target, result["parity"]["outputs"])
            norm = result["fusions"]["norm"]
            assert norm["fused"] == norm["total"] == NORMS[name], (target, norm["missed"])
            gelu = result["fusions"]["gelu"]
            assert gelu["fused"] == gelu["total"], (target, gelu["missed"])
            attention = result["fusions"]["attention"]
            assert attention["fused"] == attention["total"] == ATTENTION[name], (
                target,
                attention["missed"],
            )
            recurrent = result["fusions"]["recurrent"]
            assert recurrent["total"] == RECURRENT.get(name, 0), recurrent
            assert recurrent["fused"] == (recurrent["total"] if target == "ort" else 0)
            if target != "ort":
                assert not any(op.startswith("com.microsoft") for op in result["ops"])
