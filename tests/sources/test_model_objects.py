"""Model objects from Python (tfgraph.sources.objects): routing, what is left untouched, the
tokenizer given with a model, and one-line errors — without exporting."""

import logging

import pytest
import torch
from tiny_text import tiny_gpt, tiny_llama, word_tokenizer

import tfgraph
from tfgraph.errors import TfgraphError
from tfgraph.sources import from_module, load_source
from tfgraph.sources.loading import from_object
from tfgraph.sources.objects import with_tokenizer


def test_a_pretrained_model_goes_to_the_hugging_face_source():
    model = tiny_llama()
    source = from_module(model)  # its forward returns a DynamicCache: not the generic path
    assert source.origin == "object:LlamaForCausalLM"
    assert source.input_names == ("input_ids", "attention_mask")
    assert source.output_names == ("logits",) and source.info["causal_lm"]
    inputs = source.inputs(2, 5)
    with torch.no_grad():
        expected = model(**inputs).logits
    torch.testing.assert_close(source.eager(inputs)["logits"], expected)


def test_a_module_with_examples_and_paths():
    model = tiny_gpt()
    source = load_source((model, torch.tensor([[3, 9, 40]])))
    assert source.origin == "module:TinyGPT" and source.input_names == ("input_ids",)
    assert source.dynamic_axes["input_ids"] == {0: "batch", 1: "sequence"}


def test_a_bf16_model_is_traced_from_an_fp32_copy(caplog):
    model = tiny_llama().to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="tfgraph.sources.objects"):
        source = from_object(model)
    assert "LlamaForCausalLM is in bfloat16: exporting an fp32 copy" in caplog.text
    assert next(model.parameters()).dtype == torch.bfloat16  # the user's object is unchanged
    assert {p.dtype for p in source.module.parameters()} == {torch.float32}


def test_path_objects_are_model_arguments(hf_gpt2_dir):
    from pathlib import Path

    assert load_source(Path(hf_gpt2_dir)).origin == f"hf:{hf_gpt2_dir}"


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        (42, "cannot export a int: give an nn.Module, (nn.Module, example_inputs)"),
        ("owner/not-here", "hf download owner/not-here --local-dir not-here"),
    ],
)
def test_what_is_not_a_model(model, needle, tmp_path):
    with pytest.raises(TfgraphError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        tfgraph.export(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_tokenizers_given_with_a_model(tmp_path):
    import tokenizers

    source = load_source("gpt-tiny")
    assert with_tokenizer(source, None) is source
    fast = word_tokenizer()
    assert with_tokenizer(source, fast).tokenizer is fast
    raw = with_tokenizer(source, fast.backend_tokenizer).tokenizer  # a tokenizers.Tokenizer
    assert isinstance(fast.backend_tokenizer, tokenizers.Tokenizer)
    assert raw("w1 w2")["input_ids"] == fast("w1 w2")["input_ids"]
    fast.save_pretrained(tmp_path / "tok")
    from_dir = with_tokenizer(source, tmp_path / "tok").tokenizer  # a directory of its files
    assert from_dir("w5 w6")["input_ids"] == [8, 9]
    saved = with_tokenizer(source, fast).save_tokenizer(tmp_path / "stage")
    assert "tokenizer/tokenizer.json" in saved
    assert all((tmp_path / "stage" / f).is_file() for f in saved)
    with pytest.raises(TfgraphError, match="tokenizer= takes a transformers tokenizer"):
        with_tokenizer(source, 42)
    with pytest.raises(TfgraphError, match="tokenizer directory '.*missing' does not exist"):
        with_tokenizer(source, tmp_path / "missing")
