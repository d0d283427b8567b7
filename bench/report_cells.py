"""How ``BENCHMARKS.md`` writes a duration: the cell format its sections share."""

from __future__ import annotations


def ms(seconds: float) -> str:
    """Milliseconds, two decimals below 10 ms and one above."""
    ms = seconds * 1000
    return f"{ms:.2f} ms" if ms < 10 else f"{ms:.1f} ms"
