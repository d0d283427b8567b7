"""Hugging Face models that failed to trace or to take their inputs, each exported tiny from
its config (random init, nothing downloaded) and compared with eager:

- LongT5 and SwitchTransformers build their default encoder mask only outside torch.export:
  the seq2seq wrapper states an all-ones mask;
- SigLIP 2 takes images cut into patches with their grids (NaFlex): three inputs;
- BLT's ``Categorical(logits=…)`` validates its argument (data-dependent): validation is off
  while tracing, as are Hugging Face's ``torch_compilable_check`` asserts (SigLIP 2's)."""

import json
import os

import pytest
import torch

import tfgraph
from tfgraph.sources import trace
from tfgraph.sources.model import ModelSource

transformers = pytest.importorskip("transformers")
coverage = pytest.importorskip("tfgraph.tools.coverage")


def _save(model_type: str, kind: str, cls_name: str, path):
    cls = getattr(transformers, cls_name)
    config = coverage.config_for(cls, coverage.tiny_config(model_type, kind))
    torch.manual_seed(0)
    cls(config).eval().save_pretrained(path)
    return path


# model type, coverage kind, class, (attention fused, total)
CASES = {
    "longt5": ("seq2seq-lm", "LongT5ForConditionalGeneration", (6, 6)),  # local: ... einsum
    "switch_transformers": ("seq2seq-lm", "SwitchTransformersForConditionalGeneration", (6, 6)),
    "siglip2": ("vision", "Siglip2ForImageClassification", (2, 2)),
}


# slow: the two encoder-decoders' traces (30 s each); SigLIP2's stays in the default tier
@pytest.mark.parametrize(
    "model_type",
    [m if m == "siglip2" else pytest.param(m, marks=pytest.mark.slow) for m in CASES],
)
def test_exports_and_matches_eager(model_type, tmp_path):
    kind, cls_name, attention = CASES[model_type]
    hf = _save(model_type, kind, cls_name, tmp_path / "hf")
    report = tfgraph.export(str(hf), tmp_path / "out").report
    assert report["parity"]["passed"], report["parity"]["outputs"]
    fused = report["fusions"]["attention"]
    assert (fused["fused"], fused["total"]) == attention


class _Entropy(torch.nn.Module):
    """BLT's patcher (modeling_blt.py: ``Categorical(logits=logits).entropy()``), alone."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)

    def forward(self, input_ids):
        return torch.distributions.Categorical(logits=self.embed(input_ids)).entropy()


def test_distribution_validation_does_not_branch_the_trace():
    """Validated, ``Categorical`` asks whether the logits are finite (data-dependent); BLT then
    failed at modeling_blt.py:915. (BLT's own parity still fails apart from this: its hash
    embeddings' int64 ``prime ** k`` wraps in PyTorch, not in ONNX Runtime's Pow.)"""

    def make(batch, seq, generator):
        return {"input_ids": torch.randint(0, 50, (batch, seq), generator=generator)}

    axes = {"input_ids": {0: "batch", 1: "sequence"}}
    source = ModelSource(_Entropy(), ("input_ids",), ("entropy",), axes, make, "test:entropy")
    graph = trace.trace(source)
    assert [d for d in graph.graph.outputs[0].shape] == ["batch", "sequence"]


def test_naflex_inputs(tmp_path):
    """SigLIP 2: patches (batch, 256, 3 × 8 × 8), a padding mask over them, a grid per image."""
    kind, cls_name, _ = CASES["siglip2"]
    hf = _save("siglip2", kind, cls_name, tmp_path / "hf")
    source = tfgraph.sources.loading.load_source(
        str(hf), trust_remote_code=False, attn_implementation=None
    )
    made = source.inputs(3, 5)
    assert made["pixel_values"].shape == (3, 256, 192)
    assert made["spatial_shapes"].tolist() == [[16, 16], [15, 16], [15, 16]]
    assert made["pixel_attention_mask"].sum(-1).tolist() == [256, 240, 240]
    tfgraph.export(str(hf), tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    shapes = {i["name"]: i["shape"] for i in manifest["inputs"]}
    assert shapes == {
        "pixel_values": ["batch", 256, 192],
        "pixel_attention_mask": ["batch", 256],
        "spatial_shapes": ["batch", 2],
    }


def test_value_checks_are_off_only_while_tracing():
    validate = torch.distributions.Distribution._validate_args
    os.environ.pop("TRANSFORMERS_DISABLE_TORCH_CHECK", None)
    with trace._without_value_checks():
        assert os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] == "1"
        assert not torch.distributions.Distribution._validate_args
    assert "TRANSFORMERS_DISABLE_TORCH_CHECK" not in os.environ
    assert torch.distributions.Distribution._validate_args == validate
