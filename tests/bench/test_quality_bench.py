"""bench/quality.py: the windows it cuts, the table it writes, and (slow) a real run on the
reference model's first tokens: fp32 costs nothing, int4 RTN costs something."""

from __future__ import annotations

import pytest

from tfgraph.bench import quality


def test_windows_score_every_token_once():
    for count in (2, 257, 512, 513, 1000):
        spans = quality.windows(count, 256)
        targets = [t for a, b in spans for t in range(a + 1, b + 1)]
        assert targets == list(range(1, count)), count
        assert all(b - a <= 256 for a, b in spans)


def test_markdown_lists_every_row():
    figures = {
        "ppl": 80.0, "delta_ppl": 0.5, "delta_ppl_pct": 0.63, "kl_mean": 0.004,
        "kl_max": 0.2, "top1": 0.95, "max_abs_logit_diff": 0.7, "size_mb": 14.3,
    }  # fmt: skip
    result = {
        "model": "m", "text": "t", "tokens": 513, "windows": 3, "window": 256,
        "reference": {"ppl": 79.5}, "decode": "d",
        "rows": [
            {"name": "int4 rtn b32 sym", "engine": "tfgraph", **figures, "decode_ms": 31.5},
            {"name": "llama.cpp Q4_0", "engine": "llama.cpp", "error": "RuntimeError: boom"},
        ],
    }  # fmt: skip
    lines = quality.markdown(result).splitlines()
    row = next(line for line in lines if line.startswith("| int4 rtn b32 sym"))
    assert "| 14.3 | 31.50 | 80.000 | +0.500 | +0.63 |" in row
    assert any("RuntimeError: boom" in line for line in lines)
    assert "79.500" in lines[0]


# slow: three exports of the reference model and their decode timing (~2-8 min on 2 busy cores)
@pytest.mark.slow
def test_quick_bench_on_the_reference_model(tmp_path):
    result = quality.bench(work=tmp_path, llama=None, max_tokens=513, rounds=1, quick=True)
    rows = {row["name"]: row for row in result["rows"]}
    assert result["tokens"] == 513 and result["windows"] == 2
    assert {"fp32", "int8 weights b32", "int4 rtn b32 sym"} <= set(rows)
    fp32, int4 = rows["fp32"], rows["int4 rtn b32 sym"]
    assert abs(fp32["delta_ppl_pct"]) < 1e-3 and fp32["kl_mean"] < 1e-6 and fp32["top1"] > 0.999
    assert int4["delta_ppl"] > 0 and int4["kl_mean"] > 1e-4 and int4["top1"] < 1
    for row in (fp32, int4):
        assert row["tokens"] == 512 and row["size_mb"] > 0 and row["decode_ms"] > 0
    assert int4["size_mb"] < rows["int8 weights b32"]["size_mb"] < fp32["size_mb"]
    table = quality.markdown(result)
    assert all(f"| {name} |" in table for name in rows)
