"""Report: exact percentiles, SLO violations per class, the JSON keys and the PNG."""

import orjson
import pytest

from loadgen.report import arrivals_text, build_report, length_objective_s, summarize, write_report
from loadgen.runner import RequestRecord


def rec(i: int, cls: str, ttft: float | None, *, error: str | None = None, tokens: int = 11) -> RequestRecord:
    r = RequestRecord(f"c{i}", "test", 0, "hi", 16, start_s=float(i), laps_class=cls, status=200)
    if error is not None:
        r.error, r.end_s = error, i + 0.5
        return r
    r.ttft_s, r.e2e_s, r.end_s = ttft, 2.0 * (ttft or 0.1), i + 2.0 * (ttft or 0.1)
    r.completion_tokens = tokens
    r.tpot_s = (r.e2e_s - (ttft or 0.0)) / (tokens - 1) if ttft is not None else None
    return r


def test_summarize_matches_linear_interpolation_percentiles():
    assert summarize(float(v) for v in range(1, 101)) == pytest.approx({"mean": 50.5, "p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert summarize([2.0]) == {"mean": 2.0, "p50": 2.0, "p90": 2.0, "p99": 2.0}
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


@pytest.fixture
def records():
    short = [rec(i, "short", 0.01 * (i + 1)) for i in range(50)]  # 0.01 .. 0.50 s
    long = [rec(50 + i, "long", 0.2 * (i + 1)) for i in range(5)]  # 0.2 .. 1.0 s
    bad = [rec(55, "unknown", None, error="HTTP 503: no engine"), rec(56, "short", None, error="HTTP 503: no engine"),
           rec(57, "long", None, error="timeout after 5 s")]
    return short + long + bad


def test_report_counts_stats_and_slo_violations(records):
    report = build_report(records, slo_ttft_s=0.4, meta={"dataset": "test", "rate": 2.0, "seed": 1})
    assert report["dataset"] == "test" and report["rate"] == 2.0 and report["seed"] == 1
    assert report["requests"] == {"sent": 58, "ok": 55, "errors": 3}
    assert report["conversations"] == 58
    ok_ttfts = [0.01 * (i + 1) for i in range(50)] + [0.2 * (i + 1) for i in range(5)]
    assert report["ttft_s"] == summarize(ok_ttfts)
    # short: 10 over 0.4 s + 1 error; long: 3 over + 1 error; unknown: 1 error; all: 16 of 58
    assert report["slo"] == {"ttft_s": 0.4, "violations": 16, "violation_rate": 16 / 58}
    short, long = report["by_class"]["short"], report["by_class"]["long"]
    assert (short["count"], short["ok"], short["errors"]) == (51, 50, 1)
    assert short["slo_violation_rate"] == 11 / 51
    assert short["ttft_s"]["p50"] == pytest.approx(0.255)
    assert short["ttft_s"]["p99"] == pytest.approx(0.4951)
    assert long["ttft_s"] == pytest.approx({"mean": 0.6, "p50": 0.6, "p90": 0.92, "p99": 0.992})
    assert long["slo_violation_rate"] == 4 / 6
    assert long["tpot_s"]["p50"] == pytest.approx(0.06)
    assert report["by_class"]["unknown"]["count"] == 1
    assert report["errors_by_message"] == {"HTTP 503: no engine": 2, "timeout after 5 s": 1}
    assert report["duration_s"] == 57.5  # the last record (an error) ends at 57 + 0.5 s
    assert report["throughput_rps"] == pytest.approx(55 / 57.5)
    assert report["output_tokens_per_s"] == pytest.approx(55 * 11 / 57.5)


def test_empty_classes_still_have_their_keys():
    report = build_report([rec(0, "short", 0.1)], slo_ttft_s=0.4)
    assert set(report["by_class"]) == {"short", "long"}
    assert report["by_class"]["long"] == {
        "count": 0, "ok": 0, "errors": 0, "ttft_s": summarize([]), "tpot_s": summarize([]), "e2e_s": summarize([]),
        "slo_violation_rate": None,
    }


def test_write_report_writes_json_with_required_keys_and_png(records, tmp_path):
    report = build_report(records, slo_ttft_s=0.4, meta={"dataset": "test", "rate": 2.0, "seed": 1})
    written = []
    write_report(report, records, tmp_path / "out" / "run.json", written)
    png_path, json_path = written  # the plot first
    assert png_path == tmp_path / "out" / "run.png"
    loaded = orjson.loads(json_path.read_bytes())
    for key in ("requests", "duration_s", "throughput_rps", "ttft_s", "tpot_s", "e2e_s", "slo", "by_class", "dataset", "rate", "seed",
                "errors_by_message"):
        assert key in loaded
    assert set(loaded["ttft_s"]) == {"mean", "p50", "p90", "p99"}
    assert set(loaded["by_class"]["long"]) >= {"count", "ttft_s", "tpot_s", "e2e_s", "slo_violation_rate"}
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = []
    write_report(build_report([], slo_ttft_s=0.4), [], tmp_path / "empty.json", written)
    empty_png, _ = written
    assert empty_png.stat().st_size > 0


def test_the_length_aware_objective_allows_time_per_new_prompt_token():
    records = [rec(0, "short", 0.3), rec(1, "long", 0.9), rec(2, "long", 1.2), rec(3, "long", None, error="HTTP 502: x")]
    for r, (prompt, cached) in zip(records, [(100, 0), (12_000, 2_000), (12_000, 2_000), (5_000, 0)]):
        r.prompt_tokens, r.cached_tokens = prompt, cached
    # 0.4 s + 0.06 s per 1k new tokens: 0.406 s, 1.0 s, 1.0 s; the failed one is a violation whatever its objective.
    report = build_report(records, slo_ttft_s=0.4, slo_ttft_per_1k_s=0.06)
    assert report["slo"]["violation_rate"] == 0.75  # fixed: the two long answers and the failure
    assert report["length_slo"] == {"ttft_s": 0.4, "per_1k_new_tokens_s": 0.06, "violations": 2, "violation_rate": 0.5}
    assert report["by_class"]["long"]["length_slo_violation_rate"] == pytest.approx(2 / 3)
    assert "length_slo" not in build_report(records, slo_ttft_s=0.4)


def test_the_length_aware_objective_counts_the_new_tokens_the_gateway_saw_at_arrival():
    # A question on a 20k-token document that another request was still prefilling on its engine: nothing of it was
    # cached anywhere when it arrived (the gateway's L: 20,000), all of it once it started (the engine's report).
    waited = rec(0, "long", 0.9)
    waited.prompt_tokens, waited.cached_tokens, waited.new_tokens_est = 20_000, 19_990, 20_000
    unknown = rec(1, "long", 0.9)
    unknown.prompt_tokens, unknown.cached_tokens = 20_000, 19_990  # no x-laps-new-tokens: the engine's count
    assert length_objective_s(waited, 0.4, 0.06) == pytest.approx(1.6)
    assert length_objective_s(unknown, 0.4, 0.06) == pytest.approx(0.4006)
    assert build_report([waited, unknown], slo_ttft_s=0.4, slo_ttft_per_1k_s=0.06)["length_slo"]["violations"] == 1


def test_the_summary_line_names_the_arrival_rate_and_burstiness_as_given():
    assert arrivals_text({"rate": 3.0, "burstiness": 1.0}) == " (3 conv/s, Poisson)"
    assert arrivals_text({"rate": 1.0000001, "burstiness": None}) == " (1.0000001 conv/s, Poisson)"
    assert arrivals_text({"rate": 11403.5, "burstiness": 0.25}) == " (11403.5 conv/s, gamma gaps of burstiness 0.25)"
    assert arrivals_text({"rate": None, "burstiness": 1.0}) == ""  # a replayed trace keeps its own times
