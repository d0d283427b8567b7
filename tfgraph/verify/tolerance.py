"""Parity's default shapes and the fp32 tolerance."""

from __future__ import annotations

from dataclasses import dataclass

PARITY_SHAPES = ((1, 7), (2, 33))  # (batch, sequence)


@dataclass(frozen=True)
class Tolerance:
    atol: float = 1e-4
    rtol: float = 1e-3

    def as_dict(self) -> dict:
        return {"atol": self.atol, "rtol": self.rtol}


FP32 = Tolerance()

__all__ = ["FP32", "PARITY_SHAPES", "Tolerance"]
