"""The committed reference decoder (bench/reference_model/, trained by
``python -m tfgraph.tools.train_reference``, issue 48): it loads as any Hugging Face
directory, is bf16 under 40 MB, and its perplexity on its held-out text (weights upcast to
fp32) is the stated figure (figures.json) within 1%."""

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tfgraph.tools.train_reference import perplexity  # noqa: E402

REFERENCE = Path(__file__).resolve().parents[2] / "bench" / "reference_model"


def test_reference_perplexity_is_the_stated_figure():
    figures = json.loads((REFERENCE / "figures.json").read_text())
    assert (REFERENCE / "model.safetensors").stat().st_size <= 40e6
    model = transformers.AutoModelForCausalLM.from_pretrained(REFERENCE)
    assert next(model.parameters()).dtype == torch.bfloat16
    tokenizer = transformers.AutoTokenizer.from_pretrained(REFERENCE)
    ids = torch.tensor(tokenizer((REFERENCE / "heldout.txt").read_text())["input_ids"])
    ppl = perplexity(model.float().eval(), ids, figures["context"])
    assert ppl == pytest.approx(figures["heldout_ppl"], rel=0.01)
    # trained: far below the uniform guess over the vocabulary
    assert ppl < len(tokenizer) / 50
