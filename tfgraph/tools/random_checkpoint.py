"""A random-init Hugging Face checkpoint of any size, written one tensor at a time.

``write_random_checkpoint(config, directory, dtype="bf16")`` writes what ``save_pretrained``
would (``config.json``, safetensors shards, ``model.safetensors.index.json`` when sharded)
without ever building the model: the tensor names and shapes come from the model built on the
meta device, each tensor is drawn (normal with the config's ``initializer_range`` for matrices,
ones for norm scales, zeros for biases, seeded per tensor), converted and appended to its shard,
then dropped. Memory stays at one tensor whatever the model's size, so tests and benches can
write 7B checkpoints on a 24 GiB machine.

    python -m tfgraph.tools.random_checkpoint llama2-7b OUT --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import logging
import struct
import sys
import zlib
from pathlib import Path

import torch

from tfgraph.sources.checkpoint import INDEX_FILE

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
SHARD_BYTES = 2 * 1024**3

# Shapes of published models (random weights): what the scale bench exports. Each names its
# model type, the architecture its hub checkpoint declares, and the published config's sizes.
SHAPES = {
    "llama-120m": dict(
        model_type="llama", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
    ),
    "tinyllama-1.1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
    ),
    "llama2-7b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
    ),
    "qwen2-1.5b": dict(
        model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "mistral-7b": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, sliding_window=4096,
    ),
    "bloom-7b1": dict(
        model_type="bloom", hidden_size=4096, n_layer=30, n_head=32, vocab_size=250880,
    ),
    "mpt-7b": dict(
        model_type="mpt", d_model=4096, n_heads=32, n_layers=32, expansion_ratio=4,
        max_seq_len=2048, vocab_size=50432, no_bias=True,
    ),
    "gpt2-xl": dict(
        model_type="gpt2", n_embd=1600, n_layer=48, n_head=25, n_positions=1024,
        vocab_size=50257,
    ),
    "bert-large": dict(
        model_type="bert", architecture="BertModel", hidden_size=1024, num_hidden_layers=24,
        num_attention_heads=16, intermediate_size=4096, vocab_size=30522,
        max_position_embeddings=512,
    ),
    "roberta-large": dict(
        model_type="roberta", architecture="RobertaModel", hidden_size=1024,
        num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, vocab_size=50265,
        max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
    ),
    "t5-large": dict(
        model_type="t5", d_model=1024, d_ff=4096, d_kv=64, num_heads=16, num_layers=24,
        vocab_size=32128,
    ),
    "flan-t5-large": dict(
        model_type="t5", d_model=1024, d_ff=2816, d_kv=64, num_heads=16, num_layers=24,
        vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
    ),
    "flan-t5-xl": dict(
        model_type="t5", d_model=2048, d_ff=5120, d_kv=64, num_heads=32, num_layers=24,
        vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
    ),
    "bart-large": dict(
        model_type="bart", d_model=1024, encoder_layers=12, decoder_layers=12,
        encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=4096,
        decoder_ffn_dim=4096, vocab_size=50265, max_position_embeddings=1024,
    ),
}  # fmt: skip
ARCHITECTURES = {  # model type → the class its hub checkpoints declare
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
    "bloom": "BloomForCausalLM", "mpt": "MptForCausalLM", "gpt2": "GPT2LMHeadModel",
    "t5": "T5ForConditionalGeneration", "bart": "BartForConditionalGeneration",
}  # fmt: skip
# decoders whose config takes ``max_position_embeddings`` (set to 4096, as the Llama family)
_LONG_POSITIONS = {"llama", "qwen2", "mistral"}


def shape_config(name: str, **overrides):
    """A transformers config of one of :data:`SHAPES`."""
    import transformers

    fields = {**SHAPES[name], **overrides}
    model_type = fields.pop("model_type")
    architecture = fields.pop("architecture", None) or ARCHITECTURES[model_type]
    if model_type in _LONG_POSITIONS:
        fields.setdefault("max_position_embeddings", 4096)
    config = transformers.AutoConfig.for_model(model_type, **fields)
    config.architectures = [architecture]
    return config


def tensor_layout(config, model_class=None) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, how it is drawn) of every tensor ``save_pretrained`` writes, from the
    model built on the meta device (tied weights once, persistent buffers included), under the
    names and in the layout ``save_pretrained`` writes them: transformers fuses some tensors
    as it loads them (Mixtral's per-expert ``w1``/``w2``/``w3`` into ``experts.gate_up_proj``
    and ``experts.down_proj``) and splits them back as it saves."""
    import transformers

    cls = model_class or getattr(transformers, (config.architectures or ["AutoModel"])[0])
    with torch.device("meta"):
        model = (
            cls.from_config(config) if cls is transformers.AutoModel else cls._from_config(config)
        )
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for name, param in model.named_parameters():
        tensors[name] = param
    persistent = {n for n, _ in model.state_dict(keep_vars=True).items()}
    for name, buf in model.named_buffers():
        if name in persistent and buf.dtype.is_floating_point:
            tensors[name] = buf
            kinds[name] = "zeros"
    saved = _as_saved(model, tensors)
    out = []
    for name, value in saved.items():
        kind = kinds.get(name) or (
            "normal" if value.dim() >= 2 else ("zeros" if name.endswith("bias") else "ones")
        )
        out.append((name, tuple(value.shape), kind))
    return out


def _as_saved(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (meta) renamed and reshaped as ``save_pretrained`` writes them (its
    ``revert_weight_conversion``); as they are where transformers has no such step."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers before 5: the checkpoint is the state dict
        return tensors
    return dict(revert_weight_conversion(model, dict(tensors)))


def _draw(name: str, shape, kind: str, std: float, seed: int) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros":
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * std


def write_random_checkpoint(
    config,
    directory: str | Path,
    *,
    dtype: str = "fp32",
    shard_bytes: int = SHARD_BYTES,
    seed: int = 0,
    model_class=None,
    progress=None,
) -> Path:
    """Write ``config`` with random weights into ``directory`` as ``save_pretrained`` would;
    returns the directory. ``progress(done, total)`` is told after each tensor."""
    torch_dtype = DTYPES[dtype]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    layout = tensor_layout(config, model_class)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    size = 0
    for item in layout:
        nbytes = _numel(item[1]) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    std = float(getattr(config, "initializer_range", 0.02) or 0.02)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    done = 0
    for file, items in zip(names, shards, strict=True):
        header, offset = {}, 0
        for name, shape, _ in items:
            length = _numel(shape) * itemsize
            header[name] = {
                "dtype": _NAMES[torch_dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + length],
            }
            offset += length
            weight_map[name] = file
        header["__metadata__"] = {"format": "pt"}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes
        with open(directory / file, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, shape, kind in items:
                value = _draw(name, shape, kind, std, seed).to(torch_dtype).contiguous()
                f.write(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
                done += 1
                if progress is not None:
                    progress(done, len(layout))
    if len(shards) > 1:
        total = sum(_numel(s) * itemsize for _, s, _ in layout)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    config.dtype = torch_dtype  # what save_pretrained records (torch_dtype before transformers 5)
    config.save_pretrained(directory)
    logger.info("wrote %d tensors in %d shard(s) to %s", len(layout), len(shards), directory)
    return directory


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tfgraph.tools.random_checkpoint",
        description="Write a random-init Hugging Face checkpoint, one tensor at a time.",
    )
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    def show(done, total):
        if done % 16 == 0 or done == total:
            print(f"\r  {done}/{total} tensors", end="", file=sys.stderr, flush=True)

    write_random_checkpoint(
        shape_config(args.shape), args.out, dtype=args.dtype, seed=args.seed, progress=show
    )
    print(file=sys.stderr)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
