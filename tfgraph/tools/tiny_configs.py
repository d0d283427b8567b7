"""Tiny configs for the coverage matrix: every architecture of the installed transformers made
small from its own default config (2 layers, width 64, 4 heads, vocabulary 512 …, set only
where the default has the attribute, then rebuilt so derived fields follow); a composite
config's sub-configs made tiny the same way; a hybrid keeps one layer of each kind; a few
models need per-model entries (:data:`TINY_BY_MODEL`, each with its reason).
:mod:`tfgraph.tools.coverage` builds and measures the models.
"""

from __future__ import annotations

# Attributes set where the default config has them (tiny and consistent: 4 heads × 16 = 64).
TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "embed_dim": 64,
    "dim": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "n_layers": 2,
    "num_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "d_kv": 16,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "d_ff": 128,
    "n_inner": 128,
    "hidden_dim": 128,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "image_size": 32,
    "patch_size": 8,
    "num_mel_bins": 16,
    "max_source_positions": 64,
    "max_target_positions": 128,
    # widths derived from the head size elsewhere (DeepSeek's MLA, CodeGen's rotary part)
    "qk_rope_head_dim": 16,  # = head_dim: MLA's rotary part
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "rotary_dim": 8,
    "n_shared_experts": 1,
    "n_group": 1,  # DeepSeek's grouped routing over the (now 4) experts
    "topk_group": 1,
    "index_topk": 4,  # DSA's indexer selects among the keys (its default 2048 selects them all)
    "attention_types": [[["global", "local"], 1]],  # GPT-Neo: one global + one local layer
    # tables sized apart from the vocabulary and width (measured on the meta device: BLT's
    # hash embeddings 3.0 M x 64, Gemma 4's per-layer embeddings 262 k x 512)
    "encoder_hash_byte_group_vocab": 512,
    "hidden_size_global": 64,
    "vocab_size_per_layer_input": 512,
    "hidden_size_per_layer_input": 16,
    # linear-attention and state-space layers (Gated DeltaNet, Mamba, Mamba-2)
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "state_size": 16,
    "ssm_state_size": 16,
    "mamba_d_state": 16,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "time_step_rank": 8,
    "mamba_dt_rank": 8,
    "mamba_d_ssm": 128,  # = 2 × 64: Falcon-H1's Mamba width
    "n_groups": 1,
    # hybrids whose pattern is derived from indices (one attention layer after one recurrent)
    "attn_layer_period": 2,  # Jamba: attention where i % period == offset
    "attn_layer_offset": 1,
    "attn_layer_indices": [1],  # Bamba (default: none, Mamba-2 layers only)
    # Qwen4-Exp's QSA indexer: every indexed-attention layer builds one, and the default
    # config leaves its sizes None (the model then fails: None // None)
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 16,
    "indexer_compress_ratio": 4,
}
# Per model type: hybrids whose default config does not show every kind of layer its model
# has, given each kind once (as :func:`_tiny_layer_types` does for a default pattern).
TINY_BY_MODEL = {
    # the block pattern starts recurrent, recurrent, attention: 3 layers cover both kinds
    "recurrent_gemma": {"num_hidden_layers": 3},
    # init_std 1.0 gives logits of std 8 on the tiny model (max 36): rounding alone exceeds the
    # 1e-4 atol; checkpoints are trained to the usual scale
    "cpmant": {"init_std": 0.02},
    # xLSTMConfig.qk_dim rounds up to a multiple of 64 and sizes its cache from it, while the
    # layer uses hidden·qk_dim_factor unrounded: at width 64 HF's own cached generate crashes
    # ("matC_old has wrong shape") unless the two agree
    "xlstm": {"qk_dim_factor": 1.0},
    # a window of 8 (4 each side): the default 512 puts every key of the parity lengths (7,
    # 33) inside the band, which would then go untested
    "longformer": {"attention_window": 8},
    "led": {"attention_window": 8},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},  # Mamba only
    # no default pattern (the model indexes None); one dense layer, then a MoE one
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # two hybrid layers: with one, the shared transformer Zamba ties to the first hybrid layer
    # has nothing to tie and from_config raises ("issue with your definition of
    # `tie_weights_keys`")
    "zamba": {"layer_types": ["linear_attention", "hybrid", "hybrid"]},
    # vision: per-stage lists cut with the stage count (num_stages is an alias of
    # num_hidden_layers: 2 stages of a 4-stage list ended in a 768-wide norm on 192 channels)
    "convnext": {"hidden_sizes": [16, 32], "depths": [1, 1]},
    "convnextv2": {"hidden_sizes": [16, 32], "depths": [1, 1]},
    # the top conv is round_filters(1280) x width_coefficient wide, and hidden_dim must equal
    # it: 0.1 makes it 128 (= TINY hidden_dim)
    "efficientnet": {"width_coefficient": 0.1, "depth_coefficient": 0.5},
    # the stem downsamples by 16 whatever patch_size says; 64 pixels leave 4 x 4 tokens
    "levit": {"patch_size": 16, "image_size": 64, "depths": [1, 1, 1]},
    # patch_size is the unfold window over a map already downsampled by 8-32
    "mobilevitv2": {"patch_size": 2, "image_size": 64, "width_multiplier": 0.25},
    # the adaptor's width must be the text model's hidden size / 4 (TINY hidden_size 64)
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": 16}},
}
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def tiny_config(model_type: str, kind: str = ""):
    import transformers

    default = transformers.AutoConfig.for_model(model_type)
    overrides = {k: v for k, v in TINY.items() if _has(default, k)}
    # sub-configs made tiny too: the top-level overrides never reach them, and a multimodal
    # model built from its default vision/audio/text configs has 2.7-12.7 billion parameters
    # (measured: gemma3 2.7 B, qwen2_audio 12.7 B), which killed the worker for memory
    overrides.update(_tiny_sub_configs(default))
    by_model = dict(TINY_BY_MODEL.get(model_type, {}))
    overrides.update(_tiny_layer_types(default, by_model.pop("layer_types", None)))
    for key, value in by_model.items():  # a sub-config's entries merge into its tiny dict
        if isinstance(value, dict) and isinstance(overrides.get(key), dict):
            value = {**overrides[key], **value}
        overrides[key] = value
    if _has(default, "expand") and {"head_dim", "num_heads", "hidden_size"} <= set(overrides):
        # Mamba-2: heads × head size is the expanded width
        overrides["head_dim"] = overrides["hidden_size"] * default.expand // overrides["num_heads"]
    if "kv_lora_rank" in overrides and "num_key_value_heads" in overrides:
        overrides["num_key_value_heads"] = overrides["num_attention_heads"]  # MLA: K/V per head
    if default.is_encoder_decoder:
        overrides.setdefault("decoder_start_token_id", 1)
    if kind == "causal-lm":  # BERT-style decoders (bert-generation) are causal only so
        overrides["is_decoder"] = True
    overrides.update(SPECIAL_TOKENS)
    for _ in range(len(overrides)):  # drop an override the config refuses, and retry
        try:
            return transformers.AutoConfig.for_model(model_type, **overrides)
        except Exception as exc:
            refused = [k for k in overrides if f"'{k}'" in str(exc)]
            if not refused and _pattern_key(default) in overrides:
                # a pattern the config derives itself (RecurrentGemma's read-only
                # layers_block_type): its own, cut to the tiny depth
                refused = [_pattern_key(default)]
            if not refused:
                raise
            overrides.pop(refused[0])
    return transformers.AutoConfig.for_model(model_type, **overrides)


def _tiny_layer_types(config, kinds: list[str] | None = None) -> dict:
    """A hybrid's layer pattern made tiny: each kind of layer once, in the order the default
    pattern first uses it (Qwen3-Next's three linear-attention layers to one full-attention
    layer become one of each), so that the tiny model has every kind; at least 2 layers.
    ``kinds`` (from :data:`TINY_BY_MODEL`) replaces a default pattern that lacks a kind."""
    if kinds is None:
        types = getattr(config, "layer_types", None)
        if not isinstance(types, (list, tuple)) or not types or not isinstance(types[0], str):
            return {}
        kinds = list(dict.fromkeys(types))
        if len(kinds) == 1:
            return {}
    out: dict = {_pattern_key(config): list(kinds)}
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if _has(config, key):
            out[key] = len(kinds)
    return out


def config_for(cls, config):
    """The config ``cls`` is built from: a composite config's text config where ``cls`` takes
    only that (Qwen3.5's ``Qwen3_5ForCausalLM`` under the ``qwen3_5`` model type, which has no
    ``vocab_size`` of its own), as ``AutoModelForCausalLM.from_config`` does."""
    wanted = getattr(cls, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    text = config.get_text_config()
    return text if isinstance(text, wanted) else config


def _pattern_key(config) -> str:
    """The field that holds the layer pattern: Zamba's ``layer_types`` is an alias of
    ``layers_block_type``, set only after the config derived ``hybrid_layer_ids`` from its
    default pattern (Zamba2 then looks up layers that do not exist: KeyError)."""
    return getattr(type(config), "attribute_map", {}).get("layer_types", "layer_types")


def _tiny_sub_configs(config, depth: int = 0) -> dict:
    """``{name: tiny sub-config as a dict}`` for each sub-config of a composite config (its
    nested ones made tiny too), each rebuilt from its own class with the :data:`TINY` values
    it has; a sub-config whose class refuses them keeps its default."""
    from transformers import PretrainedConfig

    out = {}
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if not isinstance(sub, PretrainedConfig) or depth > 2:
            continue
        overrides = {k: v for k, v in TINY.items() if _has(sub, k)}
        heads = ("num_attention_heads", "num_key_value_heads")
        if all(_has(sub, k) for k in heads) and len({getattr(sub, k) for k in heads}) == 1:
            # an MHA sub-config stays MHA: NeMo's ASR encoders save q/k/v fused and split them
            # in three equal parts on load, which a GQA tiny config would not survive
            overrides["num_key_value_heads"] = overrides.get("num_attention_heads")
        # special tokens inside the tiny vocabulary (mllama's text config pads with 128004)
        overrides.update({k: v for k, v in SPECIAL_TOKENS.items() if _has(sub, k)})
        # its role in the composite (SpeechEncoderDecoder's BERT decodes: causal, cross-attending)
        roles = ("is_decoder", "add_cross_attention")
        overrides.update({k: True for k in roles if _has(sub, k) and getattr(sub, k)})
        overrides.update(_tiny_sub_configs(sub, depth + 1))
        overrides.update(_tiny_layer_types(sub))  # Qwen3.5's text config keeps its attention
        built = _build(type(sub), overrides)
        if built is not None:
            out[name] = built.to_dict()
    return out


def _build(cls, overrides: dict):
    """``cls(**overrides)``, dropping an override it refuses and retrying; None if none fits."""
    overrides = dict(overrides)
    for _ in range(len(overrides) + 1):
        try:
            return cls(**overrides)
        except Exception as exc:
            refused = [k for k in overrides if f"'{k}'" in str(exc) or k in str(exc)]
            if not refused:
                return None
            overrides.pop(refused[0])
    return None


def _has(config, name: str) -> bool:
    try:
        return hasattr(config, name)
    except Exception:  # a per-layer attribute that refuses a global read
        return False
