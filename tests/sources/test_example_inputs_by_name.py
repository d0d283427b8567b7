"""Example inputs given as a dict bind to forward's parameters by name (issue 47): a mask
given as ``{"x": …, "mask": …}`` to ``forward(x, pos=None, mask=None)`` reaches ``mask``, not
``pos``, in the eager runs, the trace, parity and ``tfgraph parity``'s per-module re-run; the
graph's inputs are named by the dict's keys; tuples stay positional."""

import pytest
import torch
from ort_run import run_onnx
from third_party_models import VOCAB, KeywordMaskLM, keyword_mask_lm
from torch import nn

import tfgraph
from tfgraph.errors import TfgraphError
from tfgraph.sources import from_module, load_source
from tfgraph.verify.recheck import _eager_outputs


def _masked(source, batch=2, seq=6):
    """Inputs whose mask hides the last two positions (parity's own masks are all ones)."""
    inputs = source.inputs(batch, seq)
    inputs["mask"][:, -2:] = False
    return inputs


def test_dict_binds_by_name():
    module, example = keyword_mask_lm()
    source = from_module(module, example)
    assert source.input_names == ("x", "mask")
    assert source.keyword_inputs
    inputs = _masked(source)
    with torch.no_grad():
        want = module(x=inputs["x"], mask=inputs["mask"])
        unmasked = module(inputs["x"])
    got = source.eager(inputs)["logits"]
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, unmasked)  # the mask reached forward's mask
    assert _eager_outputs(source, inputs)  # tfgraph parity's per-module re-run binds it too


def test_factory_dict_binds_by_name():
    source = load_source("third_party_models:keyword_mask_lm")
    assert source.keyword_inputs and source.input_names == ("x", "mask")
    assert source.info["example_shape"] == [2, 7]


def test_positional_stays_positional():
    module, example = keyword_mask_lm()
    by_tuple = from_module(module, (example["x"],))
    assert by_tuple.input_names == ("x",) and not by_tuple.keyword_inputs
    pos = torch.arange(7).expand(2, 7)
    in_order = from_module(module, {"x": example["x"], "pos": pos})
    assert in_order.input_names == ("x", "pos") and not in_order.keyword_inputs


def test_unknown_key_is_refused():
    module, example = keyword_mask_lm()
    with pytest.raises(TfgraphError) as caught:
        from_module(module, {"x": example["x"], "attention_mask": example["mask"]})
    message = str(caught.value)
    assert "'attention_mask'" in message and "forward(x, pos, mask)" in message, message
    assert "\n" not in message


class _KeywordsLM(nn.Module):
    """``forward(x, **kwargs)``: a library model that takes its extras as keywords."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = KeywordMaskLM()

    def forward(self, x, **kwargs):
        return self.inner(x, mask=kwargs.get("mask"))


def test_var_keyword_forward():
    module, example = keyword_mask_lm()
    wrapper = _KeywordsLM().eval()
    wrapper.inner.load_state_dict(module.state_dict())
    source = from_module(wrapper, {"mask": example["mask"], "x": example["x"]})
    assert source.keyword_inputs and source.input_names == ("mask", "x")
    inputs = _masked(source)
    with torch.no_grad():
        want = module(inputs["x"], mask=inputs["mask"])
    torch.testing.assert_close(source.eager(inputs)["logits"], want)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One export of the dict-example model, shared by the asserts below."""
    module, example = keyword_mask_lm()
    out = tmp_path_factory.mktemp("by_name") / "out"
    return module, tfgraph.export((module, example), out)


def test_export_binds_by_name(exported):
    module, result = exported
    assert result.passed, result.report["parity"]
    assert [i["name"] for i in result.manifest["inputs"]] == ["x", "mask"]
    assert result.manifest["inputs"][0]["shape"] == ["batch", "sequence"]
    source = from_module(module, keyword_mask_lm()[1])
    inputs = _masked(source, batch=3, seq=5)
    (got,) = run_onnx(result.out_dir / "model.onnx", {n: v.numpy() for n, v in inputs.items()})
    with torch.no_grad():
        want = module(inputs["x"], mask=inputs["mask"]).numpy()
    assert got.shape == (3, 5, VOCAB)
    assert abs(got - want).max() < 1e-4  # the graph's mask input is forward's mask
