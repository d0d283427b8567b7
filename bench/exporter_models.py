"""The models of the ``exporters`` section: random-init Hugging Face configurations, saved as
checkpoints with a word-level tokenizer (nothing downloaded), which every exporter reads."""

from __future__ import annotations

from pathlib import Path

TINY = {"vocab": 1000, "hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "ffn": 512}
# a quick run's llama: 1 layer (tracing, by each exporter, is most of the section's time);
# the vocab stays 1000: the probes draw token ids below 900
QUICK_TINY = {**TINY, "layers": 1}


def model_configs(quick: bool) -> dict[str, tuple[str, object]]:
    """name → (kind, transformers config): the models every peer is tried on (``quick``: the
    llama alone, :data:`QUICK_TINY`'s size)."""
    import transformers as T

    t = QUICK_TINY if quick else TINY
    common = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    llama = {
        "vocab_size": t["vocab"],
        "hidden_size": t["hidden"],
        "intermediate_size": t["ffn"],
        "num_hidden_layers": t["layers"],
        "num_attention_heads": t["heads"],
        "num_key_value_heads": t["kv_heads"],
        "max_position_embeddings": 2048,
        **common,
    }
    configs = {
        "llama": ("causal", T.LlamaConfig(**llama)),
        "mistral": ("causal", T.MistralConfig(**llama, sliding_window=4096)),
        "gpt2": (
            "causal",
            T.GPT2Config(
                vocab_size=t["vocab"],
                n_embd=t["hidden"],
                n_layer=t["layers"],
                n_head=t["heads"],
                n_positions=2048,
                **common,
            ),
        ),
        "bloom": (
            "causal",
            T.BloomConfig(
                vocab_size=t["vocab"],
                hidden_size=t["hidden"],
                n_layer=t["layers"],
                n_head=t["heads"],
                **common,
            ),
        ),  # fmt: skip
        "t5": (
            "seq2seq",
            T.T5Config(
                vocab_size=t["vocab"],
                d_model=t["hidden"],
                d_ff=t["ffn"],
                d_kv=32,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=t["heads"],
                decoder_start_token_id=0,
                **common,
            ),
        ),  # fmt: skip
    }
    if quick:
        return {k: configs[k] for k in ("llama",)}
    configs["llama-120m"] = (
        "causal",
        T.LlamaConfig(
            **{
                **llama,
                "vocab_size": 32000,
                "hidden_size": 768,
                "intermediate_size": 2048,
                "num_hidden_layers": 12,
                "num_attention_heads": 12,
                "num_key_value_heads": 4,
            }
        ),
    )
    return configs


def save_model(name: str, kind: str, config, root: Path) -> Path:
    """A random-init checkpoint and a word-level tokenizer (the builder needs one)."""
    import torch
    import transformers as T

    out = root / name
    torch.manual_seed(0)
    cls = T.AutoModelForSeq2SeqLM if kind == "seq2seq" else T.AutoModelForCausalLM
    model = cls.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(out)
    save_tokenizer(config.vocab_size, out)
    return out


def save_tokenizer(vocab_size: int, out: Path) -> None:
    """A word-level tokenizer over ``vocab_size`` ids (``t0``, ``t1``, …) beside a checkpoint."""
    import transformers as T
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    T.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t0"
    ).save_pretrained(out)
