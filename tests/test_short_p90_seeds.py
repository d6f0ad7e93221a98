"""bench/short_p90_seeds.py's point syntax and its short-P90 check on scripted rows; dominance.py's target, exact values."""

import argparse
import json
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "short_p90_seeds.py"
_spec = importlib.util.spec_from_file_location("short_p90_seeds", BENCH)
seeds = sys.modules["short_p90_seeds"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(seeds)
dominance = sys.modules["dominance"]


def row(policy, short_s, floor_s=0.006):
    return {"policy": policy, "short_ttft_p90_s": short_s, "short_floor_s": floor_s}


def test_the_target_is_half_the_best_baseline_or_twice_the_floor_where_that_baseline_is_within_twice_it():
    assert dominance.short_p90_target_s(0.020, 0.006) == pytest.approx(0.010)  # 20 ms is past twice the 6-ms floor
    assert dominance.short_p90_target_s(0.012, 0.006) == pytest.approx(0.012)  # within twice it: twice the floor
    assert dominance.short_p90_target_s(0.012, None) == pytest.approx(0.006)  # no floor: half the baseline's


def test_the_check_takes_the_lowest_baseline_and_leaves_out_the_control():
    rows = [row("laps", 0.0127, 0.00596), row("least_load", 0.0106), row("least_load+spf", 0.01035),
            row("round_robin", None), row("least_load+spf/laps-flags", 0.001)]
    # shared-docs at 0.8x, seed 0: least_load+spf's 10.35 ms (10.91 with the gateway's 0.56 ms, as a client sees it)
    # is within twice the 5.96-ms floor, so 11.92 ms is allowed: laps' 12.7 (13.26) misses, 11.3 (11.86) would not
    check = seeds.short_check(rows)
    assert (check["best_policy"], check["best_short_p90_client_s"]) == ("least_load+spf", pytest.approx(0.01091))
    assert check["target_s"] == pytest.approx(0.01192) and check["laps_short_p90_client_s"] == pytest.approx(0.01326)
    assert check["ok"] is False
    rows[0]["short_ttft_p90_s"] = 0.0113
    assert seeds.short_check(rows)["ok"] is True


def test_a_point_without_short_requests_is_not_judged():
    check = seeds.short_check([row("laps", None), row("least_load", 0.01)])
    assert (check["target_s"], check["ok"]) == (None, None)
    assert seeds.short_check([row("laps", 0.01), row("least_load", None)])["ok"] is None


@pytest.mark.parametrize("text, expected", [("shared-docs:15.518", ("shared-docs", 15.518, False)),
                                            ("docs:101.022:pd", ("docs", 101.022, True))])
def test_a_point_is_a_workload_a_load_and_pd_or_not(text, expected):
    assert seeds.point(text) == expected


@pytest.mark.parametrize("text, says", [("nope:1", "unknown workload"), ("docs", "expected WORKLOAD:LOAD"),
                                        ("docs:1:PD", "expected WORKLOAD:LOAD"), ("docs:x", "not a number"),
                                        ("docs:0", "positive"), ("docs:nan", "positive"), ("docs:inf", "positive")])
def test_a_bad_point_is_a_usage_error_naming_it(text, says):
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        seeds.point(text)


def test_laps_exactly_on_the_target_meets_it(monkeypatch):
    monkeypatch.setattr(dominance, "GATEWAY_OVERHEAD_S", 2**-11)  # sums of powers of two are exact
    # as a client sees them, least_load 2**-6 + 2**-11 s: half of it is the target, 2**-7 + 2**-12, laps' exactly
    check = seeds.short_check([row("laps", 2**-7 - 2**-12, 2**-10), row("least_load", 2**-6)])
    assert (check["target_s"], check["laps_short_p90_client_s"], check["ok"]) == (2**-7 + 2**-12, 2**-7 + 2**-12, True)


def test_main_runs_each_point_and_seed_once_and_matches_the_rows_to_them(tmp_path, monkeypatch, capsys):
    calls_seen = []

    def fake(jobs, fn, calls, console):  # a row per call: laps 9 ms, least_load 20 ms at seed 1, 16 ms at seed 2
        calls_seen.extend(calls)
        return [{"policy": p, "short_ttft_p90_s": 0.009 if p == "laps" else (0.020 if s == 1 else 0.016) + 0.001 * (p != "least_load"),
                 "short_floor_s": 0.005} for (_, p, _, _, s, _) in calls]

    monkeypatch.setattr(seeds, "simulate_all", fake)
    out = tmp_path / "s.json"
    assert seeds.main(["--points", "docs:101.022:pd", "docs:101.022:pd", "--seeds", "2", "1", "--duration", "4",
                       "--out", str(out)]) == 0
    assert len(calls_seen) == 2 * (1 + len(seeds.BASELINES)) and {c[3] for c in calls_seen} == {4.0}
    checks = json.loads(out.read_text())["checks"]
    # as a client sees them (+0.56 ms each): seed 1, half of 20.56 ms is 10.28 ms, laps' 9.56 ms meets it; seed 2, half
    # of 16.56 ms is 8.28 ms, a miss
    assert [(c["seed"], c["best_policy"], c["target_s"], c["ok"]) for c in checks] == [
        (1, "least_load", pytest.approx(0.01028), True), (2, "least_load", pytest.approx(0.00828), False)]


@pytest.mark.parametrize("bench, patched, argv", [
    ("short_p90_seeds", "simulate_all", ["--points", "docs:1", "--seeds", "1"]),
    ("dominance", "sweep", ["--workloads", "mixed", "--jobs", "1"]),  # it fails before any workload is done
])
def test_a_run_that_fails_leaves_no_output_file(tmp_path, monkeypatch, bench, patched, argv):
    def broken(*_args, **_kwargs):
        raise RuntimeError("engine model error")

    module = {"short_p90_seeds": seeds, "dominance": dominance}[bench]
    monkeypatch.setattr(module, patched, broken)
    out = tmp_path / "out.json"
    with pytest.raises(RuntimeError):
        module.main([*argv, "--out", str(out)])
    assert not out.exists()
