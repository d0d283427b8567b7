"""Tiny Hugging Face models whose main input is not token ids, or whose class name misleads:
(class name, config) pairs built from configs (random init, nothing downloaded)."""

import torch

ENC_DEC = {
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
}
ENCODER = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def configs(transformers) -> dict:
    t = transformers
    return {
        # speech encoder-decoder: (batch, mel bins, frames), frames fixed at 2 × 16
        "whisper": (
            "WhisperForConditionalGeneration",
            t.WhisperConfig(
                vocab_size=300,
                num_mel_bins=16,
                max_source_positions=16,
                max_target_positions=64,
                decoder_start_token_id=1,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                init_std=0.2,  # greedy tokens vary (0.02 repeats one token whatever it hears)
                **ENC_DEC,
            ),
        ),
        # speech encoder-decoder: (batch, frames, features), frames dynamic
        "speech2text": (
            "Speech2TextForConditionalGeneration",
            t.Speech2TextConfig(
                vocab_size=300,
                input_feat_per_channel=16,
                input_channels=1,
                conv_channels=32,
                max_source_positions=256,
                max_target_positions=64,
                **ENC_DEC,
            ),
        ),
        "vit": (
            "ViTForImageClassification",
            t.ViTConfig(
                **ENCODER, intermediate_size=128, image_size=32, patch_size=8, num_labels=5
            ),
        ),
        "wav2vec2": (
            "Wav2Vec2Model",
            t.Wav2Vec2Config(
                **ENCODER,
                intermediate_size=128,
                conv_dim=(32, 32),
                conv_stride=(5, 4),
                conv_kernel=(10, 4),
                num_conv_pos_embeddings=16,
                num_conv_pos_embedding_groups=4,
            ),
        ),
        # an LM whose class name ends in "Model"
        "marian": (
            "MarianMTModel",
            t.MarianConfig(vocab_size=300, decoder_start_token_id=0, pad_token_id=0, **ENC_DEC),
        ),
        # a bare base model, also ending in "Model"
        "bart-base": ("BartModel", t.BartConfig(vocab_size=300, **ENC_DEC)),
    }


def save(transformers, name: str, path) -> None:
    cls, config = configs(transformers)[name]
    torch.manual_seed(0)
    getattr(transformers, cls)(config).eval().save_pretrained(path)
