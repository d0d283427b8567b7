"""``--flavour genai`` (issue 46): onnxruntime-genai's own ``og.Model`` / ``og.Generator`` /
``og.Tokenizer`` on the artifact give the tokens of tfgraph's ``generate`` on the same files.

genai right-pads a batch (its tokenizer's ``encode_batch``, or ids padded with
``pad_token_id``) and appends a column of ones to the mask at each step; tfgraph left-pads.
Both read each row's past length off the mask (exporters/flavours/genai_graph.py), so a padded
row decodes as it does alone. Models are random-init Hugging Face directories with a tiny
byte-level BPE tokenizer trained here (genai's tokenizer takes BPE, not WordLevel); weights are
drawn wide (``initializer_range``) so that greedy tokens vary.

Default tier: a tiny Llama, text prompts through genai's tokenizer, batch 1 and a padded batch
of 2; the option checks. The matrix (Llama, Qwen2, Phi-3 shapes x fp32/int4) is in
test_genai_matrix.py, slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime_genai as og
import pytest
import torch

import tfgraph
from tfgraph.errors import TfgraphError
from tfgraph.options import ExportOptions
from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner
from tfgraph.runtime.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
TEXTS = ["the quick brown fox jumps over", "a lazy dog"]
CORPUS = ["the quick brown fox jumps over the lazy dog", "a dog and a fox", "over and over"]
EOS = "<|endoftext|>"
# the models' EOS: an id the tokenizer never makes, so that a random model's rows seldom stop
# before 32 tokens (genai stops a row at EOS; both runtimes are compared up to it)
EOS_ID = 319


def write_tokenizer(path: Path) -> int:
    """A byte-level BPE trained on a few sentences, saved as GPT-2's (what genai's tokenizer
    reads); its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    fast = transformers.GPT2TokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS)
    fast.save_pretrained(path)
    return len(fast)


def make_model(path: Path, arch: str, *, hidden: int = 256, heads: int = 4) -> Path:
    """A random-init 2-layer ``arch`` (llama, qwen2, phi3) with the tokenizer, vocabulary 320
    (the tokenizer's ids and room), ``heads`` heads over 2 KV heads; seeded."""
    size = write_tokenizer(path)
    vocab = 320
    assert size <= vocab
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=2,
        max_position_embeddings=256, bos_token_id=0, eos_token_id=EOS_ID, pad_token_id=0,
        initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=False)
        cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.Phi3Config(
            **common, original_max_position_embeddings=256, rope_scaling=None
        )
        cls = transformers.Phi3ForCausalLM
    with torch.random.fork_rng():
        torch.manual_seed(0)
        cls(config).eval().save_pretrained(path)
    return path


def export_genai(src: Path, out: Path, **options) -> Path:
    result = tfgraph.export(str(src), out, kv_cache=True, flavour="genai", **options)
    assert result.passed, result.report["parity"]
    return out


def until_eos(tokens, eos: int) -> list[int]:
    """Tokens before the first EOS: genai stops a row there (a batch of one leaves the EOS
    out of its sequence, a longer batch pads the row after it)."""
    tokens = [int(t) for t in tokens]
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def genai_generate(artifact: Path, prompts: list[list[int]], **search) -> list[list[int]]:
    """``og.Generator`` on ``prompts`` (right-padded with the config's pad id, as genai's
    ``encode_batch`` pads): each row's new tokens, up to its EOS."""
    config = json.loads((artifact / "genai_config.json").read_text())["model"]
    pad, eos = config["pad_token_id"], config["eos_token_id"]
    width = max(len(p) for p in prompts)
    ids = np.array([p + [pad] * (width - len(p)) for p in prompts], np.int32)
    return _run(og.Model(str(artifact)), ids, eos, **search)


def _run(model, ids, eos: int, **search) -> list[list[int]]:
    params = og.GeneratorParams(model)
    params.set_search_options(
        max_length=ids.shape[1] + NEW_TOKENS, batch_size=ids.shape[0], **search
    )
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    while not generator.is_done():
        generator.generate_next_token()
    return [until_eos(generator.get_sequence(i)[ids.shape[1] :], eos) for i in range(len(ids))]


def tfgraph_generate(artifact: Path, prompts: list[list[int]], **config) -> list[list[int]]:
    """tfgraph's ``generate`` (left-padded) on the same artifact, stopping at genai's EOS."""
    eos = json.loads((artifact / "genai_config.json").read_text())["model"]["eos_token_id"]
    decoder = CachedDecoder(open_runner(artifact))
    got = generate(
        decoder, prompts, GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=eos, **config)
    )
    return [until_eos(row, eos) for row in got.tokens]


def test_genai_generator_gives_tfgraph_tokens(tmp_path):
    """Text in through genai's tokenizer (encode_batch right-pads), 32 greedy tokens, batch 1
    and a padded batch of 2: og.Generator's tokens are tfgraph generate's."""
    src = make_model(tmp_path / "llama", "llama", hidden=64)
    artifact = export_genai(src, tmp_path / "out")
    for name in ("genai_config.json", "tokenizer.json", "tokenizer/tokenizer.json"):
        assert (artifact / name).is_file(), name
    model = og.Model(str(artifact))
    tokenizer = og.Tokenizer(model)
    prompts = [load_tokenizer(artifact)(t)["input_ids"] for t in TEXTS]
    assert [list(tokenizer.encode(t)) for t in TEXTS] == prompts  # both readers, same ids
    assert len(prompts[0]) > len(prompts[1])  # the second row is padded
    eos = json.loads((artifact / "genai_config.json").read_text())["model"]["eos_token_id"]
    padded = tokenizer.encode_batch(TEXTS).as_numpy()
    assert padded.shape == (2, len(prompts[0]))
    theirs = _run(model, padded, eos)
    assert theirs == tfgraph_generate(artifact, prompts)
    assert _run(model, padded[1:, : len(prompts[1])], eos) == theirs[1:]  # alone, unpadded
    assert len(theirs[0]) > NEW_TOKENS // 2  # most tokens compared (not cut short by EOS)
    assert len(set(theirs[0])) > 3  # the tokens vary: a wrong row would show


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"kv_cache": False}, "add --kv-cache"),
        ({"target": "onnx"}, "--target ort"),
        ({"kv_dtype": "int8"}, "--kv-dtype"),
        ({"row_lengths": False}, "--no-row-lengths"),
    ],
)
def test_genai_refuses_options_it_cannot_lay_out(fields, needle):
    """Before any slow work, one line naming the fix."""
    options = ExportOptions(**{"kv_cache": True, "flavour": "genai", **fields})
    with pytest.raises(TfgraphError, match=needle) as caught:
        options.resolved()
    assert "\n" not in str(caught.value)


def test_a_model_without_an_attention_mask_is_refused_before_tracing(tmp_path, no_trace):
    """A preset takes no attention_mask, which genai reads each row's length from: one line,
    before the trace (which would take the time of a whole export), nothing written."""
    with pytest.raises(TfgraphError, match="takes no attention_mask") as caught:
        tfgraph.export("gpt-tiny", tmp_path / "out", kv_cache=True, flavour="genai")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()
