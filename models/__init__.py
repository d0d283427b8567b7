"""The model zoo: transformer definitions written the textbook way, with named presets."""

from .config import ModelConfig
from .presets import PRESETS, build, describe

__all__ = ["PRESETS", "ModelConfig", "build", "describe"]
