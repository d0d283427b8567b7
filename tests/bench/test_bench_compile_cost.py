"""The compile-cost benchmark in a reduced mode: schema and sanity, no timing assertions."""

import json
import math

import pytest

from tfgraph.bench import compile_cost


def test_growth_per_doubling():
    assert compile_cost.growth(2, 4, 1.0, 2.0) == pytest.approx(2.0)  # linear
    assert compile_cost.growth(2, 8, 1.0, 16.0) == pytest.approx(4.0)  # quadratic
    assert compile_cost.growth(2, 8, 0.0, 1.0) is None
    rows = [
        {"layers": n, "total_s": t, "trace_s": t / 2, "passes_s": t / 4}
        for n, t in ((2, 1.0), (8, 4.0), (32, 16.0))
    ]
    doubling = compile_cost.per_doubling(rows)
    assert doubling["total"] == pytest.approx([2.0, 2.0])
    assert doubling["trace"] == pytest.approx([2.0, 2.0])
    assert doubling["total_overall"] == pytest.approx(2.0)


# slow: 1.5 min of exports timed; its schema tests stay in the default tier
@pytest.mark.slow
def test_reduced_run(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cost, "QUICK_LAYERS", [1, 2])
    messages = []
    result = compile_cost.run(True, tmp_path, progress=messages.append)
    json.dumps(result, allow_nan=False)  # the runner writes it as JSON

    assert result["layers"] == [1, 2]
    assert result["preset"] == "gpt-tiny" and result["d_model"] == 64
    assert [row["layers"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        for key in ("total_s", "trace_s", "passes_s", "save_s", "parity_s"):
            assert row[key] > 0, (key, row)
        assert row["total_s"] >= row["trace_s"]
        assert row["parity_passed"]
        assert {"FuseAttentionPass", "FuseNormsPass"} <= set(row["per_pass"])
        assert all(seconds >= 0 for seconds in row["per_pass"].values())
    doubling = result["per_doubling"]
    for key in ("total", "trace", "passes"):
        assert len(doubling[key]) == 1
        assert all(math.isfinite(x) and x > 0 for x in doubling[key])
    assert math.isfinite(doubling["total_overall"]) and doubling["total_overall"] > 0
    assert any("2 layers" in m for m in messages)
