"""The model zoo: transformer definitions written the textbook way, with named presets."""

from tfgraph.models.config import ModelConfig
from tfgraph.models.presets import PRESETS, build, describe

__all__ = ["PRESETS", "ModelConfig", "build", "describe"]
