"""bench/scale_out.py: the figures it derives from a run's requests (completed, failed,
latencies, tokens checked across runs) and its plot; the run itself needs haproxy and minutes
(``python -m tfgraph.bench.scale_out --quick``)."""

from __future__ import annotations

from tfgraph.bench import scale_out


def _request(client, request, replica, tokens, sent, stamps, error=None):
    return {"client": client, "request": request, "replica": replica, "tokens": tokens,
            "stamps": stamps, "error": error, "sent": sent, "ended": stamps[-1] if stamps
            else sent + 0.5}  # fmt: skip


def test_summary_counts_only_completed_requests_in_rates_and_latencies():
    results = [
        _request(0, 0, "r0", [1, 2, 3], 0.0, [0.1, 0.2, 0.4]),
        _request(1, 0, "r1", [4, 5], 1.0, [1.3, 1.4]),
        _request(2, 0, "r0", [6], 0.0, [0.2], error="RuntimeError: the stream ended"),
    ]
    s = scale_out.summary(results, seconds=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["tokens_per_s"] == 2.5  # 5 tokens of completed requests over 2 s
    assert s["completed_by_replica"] == {"r0": 1, "r1": 1}
    assert s["ttft_ms_p50"] == 200.0  # 100 ms and 300 ms
    assert s["latency_ms_p99"] < 400.1 and s["latency_ms_p50"] == 400.0


def test_check_tokens_compares_each_request_with_the_reference_or_its_first_completion():
    a = [_request(0, 0, "r0", [1, 2], 0, [1, 2]), _request(0, 1, "r0", [3], 0, [1])]
    b = [_request(0, 0, "r1", [1, 2], 0, [1, 2]), _request(0, 1, "r2", [9], 0, [1]),
         _request(0, 1, "r2", [7], 0, [1], error="cut")]  # fmt: skip
    assert scale_out.check_tokens([a, b]) == {"checked": 2, "mismatched": 1}
    reference = {(0, 0): [1, 2], (0, 1): [9]}
    assert scale_out.check_tokens([a, b], reference) == {"checked": 4, "mismatched": 1}


def test_the_workload_is_the_same_for_a_client_every_time():
    assert scale_out.workload(3) == scale_out.workload(3) != scale_out.workload(4)
    assert all(8 <= len(p) <= 64 and 16 <= n <= 64 for p, n in scale_out.workload(3))


def test_markdown_renders_the_saved_run():
    import json
    from pathlib import Path

    saved = Path(__file__).resolve().parents[2] / "docs" / "bench" / "scale_out.json"
    if not saved.is_file():
        return
    text = scale_out.markdown(json.loads(saved.read_text()))
    assert text.count("\n| 1 | ") >= 1 and "| 3, one SIGKILLed |" in text
    assert "haproxy marked it DOWN" in text
