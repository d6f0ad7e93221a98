"""bench/steady_state.py: its WORKLOAD:RATE points, and one run's row on a tiny point."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # steady_state imports dominance from next to it
_spec = importlib.util.spec_from_file_location("steady_state", BENCH / "steady_state.py")
steady_state = sys.modules["steady_state"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(steady_state)


def test_points_name_a_poisson_workload_and_a_positive_rate():
    assert steady_state.point("chat-single:2000") == ("chat-single", 2000.0)
    for bad, says in (("azure-conv:3", "the workload must be one of"), ("mixed", "expected WORKLOAD:RATE"),
                      ("mixed:-3", "RATE: must be > 0, got -3"), ("mixed:x", "RATE: "), ("nope:3", "the workload must be one of")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            steady_state.point(bad)


def test_every_policy_gets_the_same_arrivals_and_a_row_of_the_documented_figures():
    rows = [steady_state.run("mixed", 5.0, policy, 2.0, 0) for policy in ("laps", "round_robin")]
    assert rows[0]["requests"] == rows[1]["requests"] > 0  # the same seed: the same conversations at the same times
    for r in rows:
        assert set(r) == {"workload", "rate", "policy", "duration_s", "requests", "slo_violation_rate", "length_slo_violation_rate",
                          "short_ttft_p90_s", "ttft_p50_s", "tpot_p50_s", "tpot_p90_s", "reply_tokens_p50", "cache_hit_rate_pct"}
        assert r["slo_violation_rate"] == 0.0 and 0.0 <= r["cache_hit_rate_pct"] < 100.0


def test_ignore_eos_runs_every_reply_to_its_max_tokens_and_without_it_replies_end_at_the_engines_end_of_text():
    natural = steady_state.run("chat-single", 20.0, "least_load", 1.0, 0)
    to_length = steady_state.run("chat-single", 20.0, "least_load", 1.0, 0, ignore_eos=True)
    assert natural["requests"] == to_length["requests"] > 0
    assert natural["reply_tokens_p50"] < 256.0 == to_length["reply_tokens_p50"]


def test_an_out_that_cannot_be_written_stops_the_bench_before_any_simulation(tmp_path):
    for out in (tmp_path, tmp_path / "file" / "sub.json"):
        (tmp_path / "file").touch()
        with pytest.raises(SystemExit) as stopped:
            steady_state.main(["--points", "mixed:1", "--out", str(out)])
        assert stopped.value.code == 2
