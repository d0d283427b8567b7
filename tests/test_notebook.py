"""The notebook acceptance test (issue 46): a model object in, text out. What a user types in a
notebook cell lies between ``# notebook`` and ``# end of notebook`` (under 10 lines each, which
:func:`test_notebook_cells_are_short` counts); the rest checks the tokens against eager greedy
decoding of the same object."""

import inspect

import torch
from tiny_text import eager_greedy, tiny_gpt, tiny_llama, word_tokenizer


def test_a_pretrained_model_object_with_its_tokenizer(tmp_path):
    model, tokenizer = tiny_llama(), word_tokenizer()  # the notebook's objects
    # notebook
    import tfgraph

    tfgraph.export(model, tmp_path / "llama", tokenizer=tokenizer, kv_cache=True)
    llm = tfgraph.load(tmp_path / "llama")
    text = llm.generate("w1 w2 w3", max_new_tokens=8)
    # end of notebook
    prompt = tokenizer("w1 w2 w3")["input_ids"]
    expected = eager_greedy(model, prompt, 8, eos=tokenizer.eos_token_id)
    assert text == tokenizer.decode(expected, skip_special_tokens=True) and text.strip()
    assert llm.generate(prompt, max_new_tokens=8) == expected  # ids in, ids out
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert hf[0, len(prompt) :].tolist() == expected  # as Hugging Face's generate decodes it
    assert (tmp_path / "llama" / "tokenizer" / "tokenizer.json").is_file()


def test_an_nn_module_object(tmp_path):
    model, tokenizer = tiny_gpt(), word_tokenizer()  # a module of the user's own
    # notebook
    import tfgraph

    tfgraph.export(model, tmp_path / "gpt", tokenizer=tokenizer, kv_cache=True)
    text = tfgraph.load(tmp_path / "gpt").generate("w7 w8", max_new_tokens=6, ignore_eos=True)
    # end of notebook
    expected = eager_greedy(model, tokenizer("w7 w8")["input_ids"], 6)
    assert text == tokenizer.decode(expected, skip_special_tokens=True) and text.strip()


def test_an_nn_module_with_example_inputs(tmp_path):
    import tfgraph

    model = tiny_gpt(seed=1)
    example = torch.tensor([[5, 9, 200, 17]])
    result = tfgraph.export((model, example), tmp_path / "gpt", kv_cache=True)
    assert result.passed and result.report["model"] == "module:TinyGPT"
    llm = tfgraph.load(tmp_path / "gpt")
    assert llm.tokenizer is None
    assert llm.generate([5, 9, 4], max_new_tokens=5) == eager_greedy(model, [5, 9, 4], 5)


def test_notebook_cells_are_short():
    for test in (test_a_pretrained_model_object_with_its_tokenizer, test_an_nn_module_object):
        source = inspect.getsource(test)
        cell = source.split("# notebook\n")[1].split("# end of notebook")[0]
        lines = [line for line in cell.splitlines() if line.strip()]
        assert 2 <= len(lines) < 10, (test.__name__, lines)
