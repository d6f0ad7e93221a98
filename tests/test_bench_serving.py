"""bench_serving's figures from request records: exact values on scripted records, its printed labels and widths."""

import pytest

from loadgen.bench_serving import RESULT_KEYS, bench_serving_metrics, format_bench_serving
from loadgen.report import build_report
from loadgen.runner import RequestRecord


def record(cid, start, ttft, itl, e2e, prompt, completion, cached, error=None):
    r = RequestRecord(cid, "t", 0, "u", 8, start, end_s=start + e2e, ttft_s=ttft, e2e_s=e2e, itl_s=list(itl),
                      prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached, error=error)
    if error is None and completion > 1:
        r.tpot_s = (e2e - ttft) / (completion - 1)
    return r


RECORDS = [
    record("a", 0.0, 0.125, [0.0625, 0.0625], 0.25, 10, 3, 4),  # content chunks at 0.125, 0.1875, 0.25 s
    record("b", 0.5, 0.25, [0.5], 1.0, 20, 2, 0),  # chunks at 0.75 and 1.25 s; in flight in seconds 0 and 1
    record("c", 0.75, None, [], 0.0, None, None, None, error="HTTP 500: boom"),
]


def test_figures_follow_bench_serving_definitions_exactly():
    m = bench_serving_metrics(RECORDS, duration_s=2.0)
    assert tuple(m) == RESULT_KEYS
    assert {k: m[k] for k in ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                              "input_throughput", "output_throughput", "total_throughput", "concurrency",
                              "max_output_tokens_per_s", "max_concurrent_requests")} == {
        "duration": 2.0, "completed": 2, "total_input_tokens": 30, "total_output_tokens": 5, "request_throughput": 1.0,
        "input_throughput": 15.0, "output_throughput": 2.5, "total_throughput": 17.5, "concurrency": 0.625,
        "max_output_tokens_per_s": 4.0, "max_concurrent_requests": 2}
    assert (m["mean_ttft_ms"], m["median_ttft_ms"], m["std_ttft_ms"]) == (187.5, 187.5, 62.5)
    assert (m["p90_ttft_ms"], m["p95_ttft_ms"], m["p99_ttft_ms"]) == pytest.approx((237.5, 243.75, 248.75))
    assert (m["mean_tpot_ms"], m["median_tpot_ms"]) == (406.25, 406.25)  # (0.25-0.125)/2 and (1.0-0.25)/1
    assert (m["mean_itl_ms"], m["median_itl_ms"], m["max_itl_ms"]) == (pytest.approx(625 / 3), 62.5, 500.0)
    assert (m["mean_e2e_latency_ms"], m["p99_e2e_latency_ms"]) == (625.0, pytest.approx(992.5))
    assert m["cache_report"] == {"total_prompt_tokens": 30, "total_cached_tokens": 4, "cache_hit_rate_pct": 13.33}


def test_no_success_gives_no_statistics_and_zero_throughput():
    m = bench_serving_metrics(RECORDS[2:], duration_s=0.0)
    assert (m["completed"], m["request_throughput"], m["mean_ttft_ms"], m["max_itl_ms"], m["max_concurrent_requests"]) == (
        0, 0.0, None, None, 0)
    assert "Mean TTFT (ms):                          -         " in format_bench_serving(m, "laps loadgen", 2.0).splitlines()


def test_the_block_prints_bench_servings_labels_and_widths():
    lines = format_bench_serving(bench_serving_metrics(RECORDS, 2.0), "laps loadgen", "trace").splitlines()
    assert lines[:5] == [
        "============ Serving Benchmark Result ============",
        "Backend:                                 laps loadgen",
        "Traffic request rate:                    trace     ",
        "Max request concurrency:                 not set   ",
        "Successful requests:                     2         ",
    ]
    assert "Request throughput (req/s):              1.00      " in lines
    assert "---------------Time to First Token----------------" in lines
    assert "Median TTFT (ms):                        187.50    " in lines
    assert "Max ITL (ms):                            500.00    " in lines
    assert lines[-2:] == ["Cache hit rate:                          13.3%", "=" * 50]


def test_the_report_carries_the_figures():
    report = build_report(RECORDS, slo_ttft_s=0.2)
    assert report["bench_serving"] == bench_serving_metrics(RECORDS, report["duration_s"])
    assert report["bench_serving"]["request_throughput"] == report["throughput_rps"]
