"""Factories of models that are not what tfgraph expects (`export bad_models:NAME` in tests)."""

import torch
from torch import nn


class SmallCNN(nn.Module):
    """A 1-D convolutional classifier over (batch, sequence, 4) features: no attention, no norm,
    no GELU; nothing for the passes to fuse."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(4, 8, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(8, 8, kernel_size=3, padding=1)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x.transpose(1, 2)))  # (B, 8, T)
        h = torch.relu(self.conv2(h))
        return self.head(h.mean(dim=2))  # (B, 3)


def small_cnn():
    torch.manual_seed(0)
    return SmallCNN(), (torch.randn(2, 6, 4),)


class ImageCNN(nn.Module):
    """A 2-D convolution over (batch, channels, height, width) images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(image)).mean(dim=(2, 3)))


def image_cnn():
    torch.manual_seed(0)
    return ImageCNN(), (torch.randn(2, 3, 8, 8),)


class Branchy(nn.Module):
    """Data-dependent control flow: which branch runs depends on the values of the input."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        if x.sum() > 0:
            x = x * 2
        return self.head(x)


def branchy():
    torch.manual_seed(0)
    return Branchy()
