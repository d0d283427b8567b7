"""A tiny Llama checkpoint directory with a tokenizer (no download) and a calibration text in
its words: what the weight methods that need data (gptq, mixed) are tested with."""

import pytest
import torch
from tiny_text import VOCAB, tiny_llama, word_tokenizer


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """tests/tiny_text.py's 2-layer Llama and its word tokenizer, saved with save_pretrained
    (a Hugging Face directory: it loads streamed, as a checkpoint does)."""
    path = tmp_path_factory.mktemp("hf") / "llama"
    tiny_llama(seed=3).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def calibration_text(tmp_path_factory):
    """600 words of the tiny tokenizer's vocabulary, seeded."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (600,), generator=generator).tolist()
    path = tmp_path_factory.mktemp("text") / "calibration.txt"
    path.write_text(" ".join(f"w{i - 3}" for i in ids))
    return path
