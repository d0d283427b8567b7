"""Models for the precision tests (factories: ``tests.precision_models:NAME``)."""

import torch
from torch import nn

from tfgraph.models import build


def loud_gpt(scale: float = 300000.0) -> nn.Module:
    """gpt-tiny whose first MLP writes values beyond fp16's 65504 into the residual stream
    (its output projection scaled by ``scale``): eager ``.half()`` overflows from there."""
    model = build("gpt-tiny", seed=3)
    with torch.no_grad():
        model.decoder.blocks[0].mlp.w2.weight.mul_(scale)
        model.decoder.blocks[0].mlp.w2.bias.mul_(scale)
    return model


class Cancellation(nn.Module):
    """``(x + 3000) − 3000`` before a projection: in fp16 the sum keeps 2 units of spacing, so
    the difference loses everything below them; only an fp32 island keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj((x + 3000.0) - 3000.0)


def cancellation():
    torch.manual_seed(0)
    return Cancellation(), torch.randn(2, 8, 16)
