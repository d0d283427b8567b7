"""The reference decoder's training script (issue 48) on a micro plan: seconds, not the
committed model's 30 minutes. It must learn (the loss falls, the held-out perplexity ends far
below the vocabulary's), hold its evaluation files out, and write a bf16 Hugging Face directory
that loads back with the same perplexity."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tfgraph.tools import train_reference as tr  # noqa: E402

MICRO = tr.Plan(
    vocab=400, hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128,
    context=64, batch=8, steps=150, lr=3e-3, warmup=5, corpus_chars=200_000,
)  # fmt: skip


def test_heldout_files_are_not_trained_on():
    train, held = tr.corpus_files()
    assert held and train and not set(train) & set(held)
    assert not any("test" in p.parts[-2:-1] for p in train + held)


# slow: 7 s of training; the default tier keeps the committed model's own check
# (test_reference_model.py) and the held-out split above
@pytest.mark.slow
def test_micro_model_learns_and_reloads(tmp_path):
    torch.set_num_threads(1)
    figures = tr.make_reference(tmp_path / "ref", MICRO)
    assert figures["first_loss"] > 5.5  # about ln 400: the random init predicts nothing
    assert figures["final_loss"] < figures["first_loss"] - 1.5
    assert figures["heldout_ppl"] < 100  # uniform over the vocabulary would be 400
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref")
    assert next(model.parameters()).dtype == torch.bfloat16
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "ref")
    held = (tmp_path / "ref" / "heldout.txt").read_text()
    ids = torch.tensor(tokenizer(held)["input_ids"])
    again = tr.perplexity(model.float(), ids, MICRO.context)
    # the bf16 checkpoint against the fp32 model it was written from: close, not equal
    assert again == pytest.approx(figures["heldout_ppl_before_bf16"], rel=0.05)
    assert again == pytest.approx(figures["heldout_ppl"], rel=1e-3)  # the figure written


# slow: two micro trainings of 5 steps (~15 s with the corpus's tokenization)
@pytest.mark.slow
def test_a_draft_reuses_its_targets_tokenizer(tmp_path):
    """``--tokenizer DIR`` (a speculative draft, issue 49): the same tokenizer.json, its own
    shape."""
    import dataclasses

    torch.set_num_threads(1)
    tr.make_reference(tmp_path / "ref", dataclasses.replace(MICRO, steps=5))
    small = dataclasses.replace(
        MICRO, steps=5, hidden=32, intermediate=64, tokenizer=str(tmp_path / "ref")
    )
    tr.make_reference(tmp_path / "draft", small)
    files = [tmp_path / name / "tokenizer.json" for name in ("ref", "draft")]
    assert files[0].read_bytes() == files[1].read_bytes()
    config = transformers.AutoConfig.from_pretrained(tmp_path / "draft")
    assert config.hidden_size == 32 and config.vocab_size == len(
        transformers.AutoTokenizer.from_pretrained(tmp_path / "ref")
    )
