"""Which tests are in the ``slow`` tier (``python -m pytest -m slow``); the rest is the default
tier, the README's test command, which must stay under 20 minutes on a 2-core machine while
covering every capability end to end at least once.

Sweeps keep a few representative cases in the default tier — chosen so that each target, each
precision and weight format, the KV cache on a decoder and an encoder-decoder, generation,
Triton, re-check, the CLI and bad inputs stay covered there — and move the rest of their cases
to ``slow``. Both tiers run in full on the same install; neither skips anything.
"""

from __future__ import annotations

# test (file::function) → the parameter ids that stay in the default tier; every other case
# of that test is slow. An empty set: the whole test is slow.
SWEEPS: dict[str, tuple[set[str], str]] = {}


def is_slow(nodeid: str) -> bool:
    """Whether the test ``nodeid`` (``tests/file.py::function[param]``) is in the slow tier."""
    name, _, param = nodeid.partition("[")
    name = name.removeprefix("tests/")
    if name not in SWEEPS:
        return False
    kept, _reason = SWEEPS[name]
    return param.rstrip("]") not in kept if param else not kept
