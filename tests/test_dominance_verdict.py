"""bench/dominance.py's verdict on scripted rows: goodput interpolation and the four checks, exact values."""

import contextlib
import importlib.util
import json
import math
import os
import random
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "dominance.py"
_spec = importlib.util.spec_from_file_location("dominance", BENCH)
dominance = sys.modules["dominance"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dominance)


def row(policy, load, rate, viol, length=None, short=0.02, floor=0.006):
    return {"policy": policy, "load": load, "rate_rps": rate, "requests": rate * 10, "duration_s": 10.0, "slo_violation_rate": viol,
            "length_slo_violation_rate": viol if length is None else length, "short_ttft_p90_s": short, "short_floor_s": floor}


def test_goodput_interpolates_the_offered_load_at_five_percent():
    rows = [row("x", 1, 100, 0.0), row("x", 2, 200, 0.03), row("x", 3, 280, 0.13), row("x", 4, 300, 0.5)]
    # Between load 2 (3%) and load 3 (13%): 5% is a fifth of the way.
    assert dominance.goodput(rows) == pytest.approx(2.2)
    assert dominance.goodput([row("x", 1, 100, 0.2)]) == 0.0


def test_verdict_checks_every_load_the_knee_goodput_and_short_p90():
    rows = []
    for load, rate, laps, best, short_laps, short_best in ((50, 100, 0.0, 0.0, 0.01, 0.1), (100, 200, 0.02, 0.06, 0.02, 0.2),
                                                          (150, 260, 0.08, 0.30, 0.03, 0.3)):
        rows.append(row("laps", load, rate, laps, short=short_laps))
        rows.append(row("least_load+spf", load, rate, best, short=short_best))
        rows.append(row("round_robin", load, rate, best + 0.1, short=short_best))
    v = dominance.verdict(rows, "w", 100.0)
    assert v["never_worse"] and v["short_p90"]
    assert v["knee"] == {"load": 100, "laps": 0.02, "best": 0.06, "best_policy": "least_load+spf", "ok": True, "floor": None}
    # laps: 5% halfway between loads 100 (2%) and 150 (8%): 125; least_load+spf: between 50 (0%) and 100 (6%): 91.7.
    assert v["goodput"]["laps_load"] == pytest.approx(125.0) and v["goodput"]["best_load"] == pytest.approx(50 + 50 * 5 / 6)
    assert v["goodput"]["ok"] and v["goodput"]["best_policy"] == "least_load+spf"
    rows[0]["slo_violation_rate"] = 0.006  # 0.6 points over the best at load 50: worse
    assert not dominance.verdict(rows, "w", 100.0)["never_worse"]


def test_short_p90_is_judged_from_half_the_saturation_load_against_twice_the_floor_where_the_baseline_is_near_it():
    def rows_at(load, laps_short, best_short):
        return [row("laps", load, load, 0.0, short=laps_short), row("least_load", load, load, 0.0, short=best_short)]
    # at 0.4x saturation nothing is judged; at 0.5x the baseline's 10 ms (10.56 as a client sees it, with the gateway's
    # 0.56 ms) is within twice the 6-ms floor: 12 ms allowed, laps' 11.43 ms (11.99) meets it, 11.45 (12.01) does not
    v = dominance.verdict(rows_at(40, 0.05, 0.010) + rows_at(50, 0.01143, 0.010), "w", 100.0)
    assert [p["short_ok"] for p in v["points"]] == [None, True] and v["short_p90"]
    assert (v["points"][1]["short_target_s"], v["points"][1]["laps_short_p90_client_s"]) == (0.012, pytest.approx(0.01199))
    v = dominance.verdict(rows_at(50, 0.01145, 0.010), "w", 100.0)
    assert [p["short_ok"] for p in v["points"]] == [False] and not v["short_p90"]


def test_a_short_p90_miss_names_the_baseline_with_the_lowest_short_p90_and_what_both_paid_in_decoding():
    def at(policy, short, tpot, e2e):
        return {**row(policy, 50, 50, 0.0, short=short, floor=0.005), "tpot_p90_s": tpot, "e2e_p90_s": e2e}
    rows = [at("laps", 0.067, 0.078, 1.73), at("least_load+spf", 0.0094, 0.134, 2.10), at("round_robin", 0.012, 0.2, 3.0)]
    v = dominance.verdict(rows, "hh-rlhf", 100.0)
    p = v["points"][0]
    # the lowest short P90 is least_load+spf's 9.4 ms (9.96 as a client sees it), within twice the 5-ms floor: the target
    # is 10 ms, and laps misses (67.56 ms as a client sees it)
    assert (p["short_ok"], p["short_target_s"], p["best_short_policy"]) == (False, 0.01, "least_load+spf")
    assert (p["laps_tpot_p90_s"], p["best_short_tpot_p90_s"], p["laps_e2e_p90_s"], p["best_short_e2e_p90_s"]) == (0.078, 0.134, 1.73, 2.10)
    assert dominance.short_miss_line(v, p) == ("  hh-rlhf at 0.50× short P90: laps 67.56 / target 10.00 ms (twice the floor; "
                                               "least_load+spf 9.96 ms); TPOT P90 78.0 / 134.0 ms, end-to-end P90 1730 / 2100 ms")
    for r in rows:  # rows of a run from before the TPOT was kept; the floor lower: half the baseline's is the target
        del r["tpot_p90_s"], r["e2e_p90_s"]
        r["short_floor_s"] = 0.002
    v = dominance.verdict(rows, "hh-rlhf", 100.0)
    assert dominance.short_miss_line(v, v["points"][0]) == ("  hh-rlhf at 0.50× short P90: laps 67.56 / target 4.98 ms "
                                                            "(half the baseline's; least_load+spf 9.96 ms)")


def test_a_pd_first_token_waits_for_the_decode_engine_whose_pass_ends_first():
    passes = dominance.PassLog()
    for engine, start_s, duration_s in (("d0", 0.0, 0.005), ("p0", 0.0, 1.0), ("d1", 0.002, 0.010), ("d0", 0.005, 0.005)):
        passes.on_pass(engine, start_s, type("Step", (), {"duration_s": duration_s})())
    decode = ["d0", "d1"]
    assert passes.wait_s(0.004, decode) == pytest.approx(0.001)  # d0 ends its pass at 5 ms, d1 at 12 ms
    assert passes.wait_s(0.005, decode) == 0.0  # d0 starts its next pass then: the request joins it
    assert passes.wait_s(0.0075, decode) == pytest.approx(0.0025)
    assert passes.wait_s(0.011, decode) == 0.0  # d0 idle since 10 ms
    assert passes.wait_s(0.011, ["p0"]) == pytest.approx(0.989)  # p0 in its 1-s pass
    assert passes.wait_s(0.011, ["d1", "d2"]) == 0.0  # d2 never passed: idle
    assert passes.wait_s(0.0, []) == math.inf


def test_the_pd_decode_floor_is_the_isolated_pass_then_the_wait_for_a_decode_pass():
    from engines.sim.latency import make_latency_model
    from loadgen.runner import RequestRecord

    def short(start_s):
        return RequestRecord("c", "test", 0, "hi", 8, start_s, ttft_s=0.02, prompt_tokens=50, cached_tokens=0,
                             laps_class="short", status=200)
    passes = dominance.PassLog()
    passes.on_pass("d0", 0.0, type("Step", (), {"duration_s": 0.010})())
    passes.on_pass("p0", 0.0, type("Step", (), {"duration_s": 0.020})())  # a prefill engine's pass: no first token there
    alone = make_latency_model().predict([(50, 0)])  # 4.9 ms: the pass ends before d0's, at 10 ms
    at_0, at_6ms = dominance.isolated_short_passes([short(0.0)]), dominance.isolated_short_passes([short(0.006)])
    assert at_0 == [(0.0, alone)]
    assert dominance.short_decode_floor_s(at_0, passes, ["d0"]) == pytest.approx(0.010 + dominance.GATEWAY_OVERHEAD_S)
    # arriving at 6 ms its prefill ends after d0's pass: d0 is idle then, and the first token leaves at once
    assert dominance.short_decode_floor_s(at_6ms, passes, ["d0"]) == pytest.approx(alone + dominance.GATEWAY_OVERHEAD_S)
    assert dominance.short_decode_floor_s(at_0, None, ["d0"]) is None  # not PD


def test_a_pd_short_p90_miss_says_where_the_decode_passes_put_the_floor():
    rows = [{**row("laps", 50, 50, 0.0, short=0.0105, floor=0.00546), "short_decode_floor_s": 0.0091},
            {**row("least_load", 50, 50, 0.0, short=0.0109, floor=0.00546), "short_decode_floor_s": 0.0092}]
    v = dominance.verdict(rows, "docs (PD 6+2)", 100.0)
    p = v["points"][0]
    assert (p["short_ok"], p["short_target_s"], p["short_decode_floor_s"]) == (False, pytest.approx(0.00573), 0.0091)
    assert dominance.short_miss_line(v, p) == (
        "  docs (PD 6+2) at 0.50× short P90: laps 11.06 / target 5.73 ms (half the baseline's; least_load 11.46 ms); "
        "a first token waits for a decode engine's pass: with the decode passes and cache hits of laps' run, the short "
        "P90 gets no lower than 9.10 ms (the target is below that)")


def test_a_goodput_ratio_without_a_baseline_goodput_is_none_not_infinite():
    rows = [row("laps", 50, 100, 0.01), row("laps", 100, 200, 0.2), row("least_load+spf", 50, 100, 0.1),
            row("least_load+spf", 100, 200, 0.3)]
    g = dominance.verdict(rows, "w", 100.0)["goodput"]
    assert (g["best_load"], g["ratio"], g["ok"]) == (0.0, None, True)  # laps meets load 50, no baseline meets any
    rows[0]["slo_violation_rate"] = 0.1
    g = dominance.verdict(rows, "w", 100.0)["goodput"]
    assert (g["laps_load"], g["ratio"], g["ok"]) == (0.0, None, False)



def test_the_verdict_sets_the_violation_floor_beside_the_knee_and_goodput():
    rows = []
    for load, laps, best, laps_floor in ((50, 0.0, 0.0, 0.0), (100, 0.04, 0.06, 0.03), (150, 0.08, 0.30, 0.07)):
        rows += [{**row("laps", load, load, laps), "violation_floor": laps_floor},
                 {**row("least_load+spf", load, load, best), "violation_floor": 0.0}]
    v = dominance.verdict(rows, "w", 100.0)
    # at the knee (load 100) laps' 4% misses 0.6 × 6%, but its floor, 3%, is 0.5 × 6%: the target is not out of reach
    assert (v["knee"]["ok"], v["knee"]["floor"]) == (False, 0.03)
    # the floor reaches 5% halfway from 100 (3%) to 150 (7%): 125; the best baseline's goodput 91.7: a ceiling of 1.36×
    g = v["goodput"]
    assert g["floor_load"] == pytest.approx(125.0) and not g["floor_capped"]
    assert g["floor_ratio"] == pytest.approx(125.0 / (50 + 50 * 5 / 6))
    assert dominance._floor_cell(v) == "3.00% / 1.36×"
    for r in rows:
        r["violation_floor"] = 0.0
    g = dominance.verdict(rows, "w", 100.0)["goodput"]
    assert g["floor_load"] == 150 and g["floor_capped"]  # never 5% at any load run: a ceiling of at least the top one
    # the length-aware objective (shared-docs) has no floor, nor have rows of an older run
    assert dominance.verdict(rows, "shared-docs", 100.0)["goodput"]["floor_load"] is None
    assert dominance._floor_cell(dominance.verdict([row("laps", 50, 50, 0.0), row("least_load+spf", 50, 50, 0.0)], "w", 50.0)) \
        == "no knee / n/a"


def test_the_verdict_gives_the_best_baselines_prefill_busy_share_and_load_at_saturation():
    rows = [{**row("laps", 100, 100, 0.02), "prefill_busy_fraction": 0.7, "prefill_load": 0.9},
            {**row("least_load+spf", 100, 100, 0.06), "prefill_busy_fraction": 0.74, "prefill_load": 0.97},
            {**row("least_load+spf", 50, 50, 0.0), "prefill_busy_fraction": 0.4, "prefill_load": 0.45}]
    v = dominance.verdict(rows, "w", 100.0)
    assert (v["prefill_busy_at_saturation"], v["prefill_load_at_saturation"]) == (0.74, 0.97)
    assert dominance._prefill_cell(v) == "74% / 0.97"
    old = dominance.verdict([row("laps", 100, 100, 0.0), row("least_load+spf", 100, 100, 0.0)], "w", 100.0)
    assert old["prefill_busy_at_saturation"] is None and old["prefill_load_at_saturation"] is None  # an older run's rows
    assert dominance._prefill_cell(old) == "n/a / n/a"


def test_prefill_busy_fraction_averages_the_prefill_engines_over_the_run():
    class Core:
        def __init__(self, busy_s):
            self.busy_s = busy_s

        def stats(self):
            return type("Stats", (), {"total_prefill_busy_s": self.busy_s})()

    config = dominance.pd_deployment("least_load")  # p0..p5 prefill, d0, d1 decode
    run = type("Run", (), {"engines": {**{f"p{i}": type("Slot", (), {"core": Core(2.0 + i)})() for i in range(6)},
                                       "d0": type("Slot", (), {"core": Core(9.0)})()}})()
    assert dominance.prefill_busy_fraction(run, config, 10.0) == pytest.approx(4.5 / 10.0)  # decode engines left out


def test_a_point_run_with_several_seeds_is_their_mean():
    a = {**row("laps", 100, 90, 0.10, short=0.02), "pd": False, "short_floor_s": None}
    b = {**row("laps", 100, 110, 0.06, short=None), "pd": False, "short_floor_s": 0.006}
    m = dominance.mean_row([a, b])
    assert (m["policy"], m["load"], m["pd"], m["seeds"]) == ("laps", 100, False, 2)
    assert m["rate_rps"] == pytest.approx(100) and m["slo_violation_rate"] == pytest.approx(0.08)
    assert m["short_ttft_p90_s"] == 0.02 and m["short_floor_s"] == 0.006  # the seeds that have one
    bursty = dominance.mean_row([{**a, "burstiness": 0.1}] * 3)
    assert bursty["burstiness"] == 0.1  # taken as it is: three 0.1s average to 0.10000000000000002


class Now:
    """A pool that runs each job at once (``multiprocessing.Pool.apply_async``'s interface)."""

    def apply_async(self, fn, args):
        result = fn(*args)
        return type("Done", (), {"get": lambda self: result})()


def test_the_sweep_averages_every_point_over_its_seeds(monkeypatch):
    burstiness_seen = set()

    def run_point(workload, policy, load, duration_s, seed, pd, burstiness):
        burstiness_seen.add(burstiness)
        return {**row(policy, load, 100.0, 0.01 * seed + (0.1 if load > 150 else 0.0)), "pd": pd, "short_floor_s": None}

    def saturation_load(workload, duration_s, seed, pd, pool, burstiness):
        burstiness_seen.add(burstiness)
        return 200.0

    monkeypatch.setattr(dominance, "run_point", run_point)
    monkeypatch.setattr(dominance, "saturation_load", saturation_load)
    progress = dominance.Progress(disable=True)
    rows, _ = dominance.sweep("mixed", False, (0.5, 1.0), 10.0, 3, Now(), progress, seeds=2, burstiness=0.25)
    assert burstiness_seen == {0.25}  # the search and every point draw the same arrival process
    assert len(rows) == 2 * len(dominance.POLICIES)
    assert {r["load"] for r in rows} == {100.0, 200.0}
    # seeds 3 and 4; every policy fails at the top load, so no load is added
    assert all(r["seeds"] == 2 and r["slo_violation_rate"] == pytest.approx(0.035 + (0.1 if r["load"] > 150 else 0.0))
               for r in rows)


def test_the_control_is_not_a_baseline_of_the_verdict_but_is_set_against_laps_alone():
    rows = []
    for load, laps, spf, control in ((50, 0.0, 0.0, 0.0), (100, 0.02, 0.06, 0.01), (150, 0.04, 0.30, 0.07)):
        rows += [row("laps", load, load, laps), row("least_load+spf", load, load, spf),
                 row(dominance.CONTROL, load, load, control)]
    v = dominance.verdict(rows, "w", 100.0)
    assert v["never_worse"]  # against least_load+spf; the control (1% at load 100) would have made it fail
    assert v["knee"]["best_policy"] == "least_load+spf" and v["goodput"]["best_policy"] == "least_load+spf"
    c = v["same_flags"]
    assert c["max_excess"] == pytest.approx(0.01)  # at load 100: laps 2%, control 1%
    assert c["knee"] == {"load": 150, "laps": 0.04, "control": 0.07}
    # laps stays under 5% to load 150; the control crosses 5% two thirds of the way from 100 (1%) to 150 (7%).
    assert c["laps_goodput_load"] == 150 and c["control_goodput_load"] == pytest.approx(100 + 50 * 4 / 6)
    without = [r for r in rows if r["policy"] != dominance.CONTROL]
    assert dominance.verdict(without, "w", 100.0)["same_flags"] is None  # an older run: no control rows


def test_the_control_runs_laps_engine_flags_under_least_load():
    config = dominance.point_config(dominance.CONTROL, False)
    shipped = dominance.load_config(dominance.SHIPPED)
    assert config.scheduling.policy == "least_load" and len(config.engines) == 8
    assert {e.role for e in config.engines} == {"laps-flags"}
    assert config.roles["laps-flags"].flags == shipped.roles["long-prefill"].flags
    # laps' engines and the control's run laps' SGLang plugin; the baselines run SGLang's own order
    assert config.roles["laps-flags"].late_requests_last and shipped.roles["short-prefill"].late_requests_last
    assert not any(r.late_requests_last for r in dominance.point_config("least_load+spf", False).roles.values())
    assert dominance.point_config("cache_aware", False).scheduling.policy == "cache_aware"
    pd = dominance.point_config(dominance.CONTROL, True)
    assert pd.roles["prefill"].flags == shipped.roles["short-prefill"].flags and pd.scheduling.policy == "least_load"
    assert pd.roles["prefill"].late_requests_last and not pd.roles["decode"].late_requests_last


def test_the_sweep_adds_loads_while_laps_or_a_baseline_still_meets_the_objective_at_the_top(monkeypatch):
    # least_load+spf passes 5% between 1.5× and 1.88×, laps between 2.34× and 2.93×; the others at 1×.
    knee = {"laps": 2.5, "least_load+spf": 1.7}

    def run_point(workload, policy, load, duration_s, seed, pd, burstiness):
        return {**row(policy, load, load, 0.2 if load / 100.0 > knee.get(policy, 1.0) else 0.0), "pd": pd,
                "short_floor_s": None}

    monkeypatch.setattr(dominance, "run_point", run_point)
    monkeypatch.setattr(dominance, "saturation_load", lambda *args: 100.0)
    rows, v = dominance.sweep("mixed", False, (1.0, 1.5), 10.0, 0, Now(), dominance.Progress(disable=True))
    # 1.5 -> 1.88 -> 2.35 -> 2.94: laps fails there, so nothing is capped any more.
    assert sorted({r["load"] for r in rows}) == [100.0, 150.0, 188.0, 235.0, 294.0]
    assert len(rows) == 5 * len(dominance.POLICIES)
    assert v["goodput"]["best_policy"] == "least_load+spf"
    assert v["goodput"]["laps_load"] == pytest.approx(235.0 + 59.0 * 0.05 / 0.2)
    assert v["knee"]["load"] == 188.0


def test_the_added_loads_stop_at_three_times_the_saturation_load():
    rows = [row("laps", 250.0, 250.0, 0.0), row("least_load", 250.0, 250.0, 0.3)]
    assert dominance.extra_load(rows, "slo_violation_rate", 2.5) is None  # 3.13× would pass 3×
    assert dominance.extra_load(rows, "slo_violation_rate", 2.0) == 2.5
    rows[0]["slo_violation_rate"] = 0.06
    assert dominance.extra_load(rows, "slo_violation_rate", 2.0) is None  # every side fails at the top


def test_a_point_says_which_class_its_violations_fall_on():
    """``docs`` at 500 conv/s for half a simulated second under least_load: both classes miss, and the overall rate
    lies between the two classes' (it is their mean weighted by the class sizes)."""
    r = dominance.run_point("docs", "least_load", 500.0, 0.5, 0)
    short, long = r["short_slo_violation_rate"], r["long_slo_violation_rate"]
    assert 0 < short < 1 and 0 < long < 1
    assert min(short, long) <= r["slo_violation_rate"] <= max(short, long)
    assert r["burstiness"] == 1.0
    assert 0 < r["tpot_p90_s"] < r["e2e_p90_s"]  # a reply's tokens come one pass apart, its end after its first


def test_a_plot_names_the_burstiness_of_gamma_arrivals_only():
    assert dominance.arrivals_label([{**row("laps", 1, 1, 0.0), "burstiness": 0.25}]) == ", gamma arrivals (burstiness 0.25)"
    for burstiness in (1.0, None):  # Poisson; a replayed trace's own times
        assert dominance.arrivals_label([{**row("laps", 1, 1, 0.0), "burstiness": burstiness}]) == ""
    assert dominance.arrivals_label([row("laps", 1, 1, 0.0)]) == ""  # a row from before the field


def test_a_bursty_point_draws_gamma_gaps_of_the_same_seed():
    _, run = dominance.simulate_point("docs", "least_load", 500.0, 0.2, 0, burstiness=0.25)
    first_s = min(rec.start_s for rec in run.records)
    assert first_s == pytest.approx(random.Random("arrivals/0").gammavariate(0.25, 1 / (500.0 * 0.25)))


def test_a_replayed_workload_replays_the_same_stretch_of_its_trace_at_every_load_and_a_poisson_one_is_capped():
    for workload in ("azure-conv", "code-burst"):
        stretches_s = {round(load * dominance.point_duration_s(workload, load, 10.0), 6) for load in (2.0, 10.0, 40.0)}
        assert stretches_s == {round(dominance.REQUESTS_PER_POINT / dominance.TRACE_RATE_RPS[workload], 6)}
    assert [dominance.point_duration_s("mixed", load, 10.0) for load in (100.0, 1000.0, 3000.0)] == [10.0, 3.0, 1.5]


@pytest.mark.parametrize("text, says", [
    ("not json", "not a dominance.py JSON"),
    ('{"rows": []}', "not a dominance.py JSON"),
    ('{"rows": [{}], "verdict": [{"workload": "x"}], "max_duration_s": 1}', "row 0 lacks workload, policy, pd, load"),
    ('{"rows": [{"workload": "x", "policy": "laps", "pd": false}], "verdict": [{"workload": "x"}], "max_duration_s": 1}',
     "row 0 lacks load"),
    ('{"rows": [[1, 2]], "verdict": [{"workload": "x"}], "max_duration_s": 1}', "row 0 is not an object, got [1, 2]"),
    ('{"rows": {"a": 1}, "verdict": [{"workload": "x"}], "max_duration_s": 1}', "its rows and verdict must be lists"),
    ('{"rows": [], "verdict": [{}], "max_duration_s": 1}', "a row or verdict lacks a field"),
    ('{"rows": [], "verdict": [], "max_duration_s": 1}', "no workload's verdict in it"),
    ('{"rows": [], "verdict": [{"workload": "x", "saturation_load": 0}], "max_duration_s": 1}',
     "x: saturation_load must be a positive number, got 0"),
    ('{"rows": [{"workload": "x", "pd": false, "policy": "laps", "load": 5}], "verdict": [{"workload": "x", "saturation_load": 5}], '
     '"max_duration_s": 1}', "x: a verdict needs rows of laps and of a baseline, found laps"),
    ('{"rows": [], "verdict": [{"workload": "x", "saturation_load": 5}], "max_duration_s": 1}',
     "x: a verdict needs rows of laps and of a baseline, found no rows"),
    ('{"rows": [], "verdict": [{"workload": "x", "saturation_load": 1' + "0" * 400 + '}], "max_duration_s": 1}',
     "x: saturation_load must be a positive number, got 1" + "0" * 400),
    ('{"rows": [{"workload": "x", "policy": "laps", "tpot_p90_s": "x"}], "verdict": [], "max_duration_s": 1}',
     "no workload's verdict in it"),
    ('{"rows": [{"workload": "x", "pd": false, "policy": "laps", "load": 5, "tpot_p90_s": "x"}], "verdict": [{"workload": "x", '
     '"saturation_load": 5}], "max_duration_s": 1}', "row 0 (x, laps, load 5): tpot_p90_s must be a number >= 0, got 'x'"),
    ('{"rows": [{"workload": "x", "pd": false, "policy": "laps", "load": 5, "slo_violation_rate": 1.5}], "verdict": '
     '[{"workload": "x", "saturation_load": 5}], "max_duration_s": 1}',
     "row 0 (x, laps, load 5): slo_violation_rate must be a number from 0 to 1, got 1.5"),
    ('{"rows": [{"workload": "docs", "pd": true, "policy": "laps", "load": 9, "short_decode_floor_s": -0.5}], '
     '"verdict": [{"workload": "docs (PD 6+2)", "saturation_load": 5}], "max_duration_s": 1}',
     "row 0 (docs (PD 6+2), laps, load 9): short_decode_floor_s must be a number >= 0, got -0.5"),
    ('{"rows": [{"workload": "x", "pd": false, "policy": "laps", "load": 1' + "0" * 400 + '}], "verdict": [{"workload": "x", '
     '"saturation_load": 5}], "max_duration_s": 1}', "row 0 (x, laps, load 100000000000000000...0000000000000000000): load must be a number >= 0, "
     "got 100000000000000000...0000000000000000000"),
    ('{"rows": [' + ", ".join(f'{{"workload": "x", "pd": false, "policy": "{p}", "load": {load}, "slo_violation_rate": 0, '
                              f'"length_slo_violation_rate": 0, "short_ttft_p90_s": 0.01, "short_floor_s": 0.005}}'
                              for p, load in (("laps", 5.05), ("least_load", 5))) +
     '], "verdict": [{"workload": "x", "saturation_load": 5}], "max_duration_s": 1}', "x: no load has rows of both laps and a baseline"),
])
def test_verdict_of_a_file_that_is_not_a_whole_dominance_json_is_a_usage_error(tmp_path, capsys, text, says):
    path = tmp_path / "earlier.json"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        dominance.main(["--verdict-of", str(path), "--out", str(tmp_path / "new" / "verdict.json")])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # the file is read and refused before --out is claimed


def test_verdict_of_an_earlier_run_is_written_to_out_its_exit_status_says_whether_laps_met_every_target(tmp_path, capsys):
    """laps at half the baseline's violations at both loads: never worse, knee 0.5x, goodput 7.5 / 5 = 1.5x, short P90
    10.56 ms as a client sees it, within twice the 6-ms floor as the baseline's: every target met, exit 0; with its
    short P90 1.5 ms more, past the 12 ms, exit 1.
    An --out that cannot be written is one error line, exit 1."""
    def earlier_run(laps_short_p90_s: float) -> Path:
        rows = [{"workload": "x", "pd": False, "policy": policy, "load": load, "slo_violation_rate": rate * share,
                 "length_slo_violation_rate": rate * share, "short_ttft_p90_s": short_s, "short_floor_s": 0.006}
                for policy, share, short_s in (("laps", 0.5, laps_short_p90_s), ("least_load", 1.0, 0.01))
                for load, rate in ((5.0, 0.05), (7.5, 0.1))]
        path = tmp_path / f"earlier-{laps_short_p90_s}.json"
        path.write_text(json.dumps({"rows": rows, "verdict": [{"workload": "x", "saturation_load": 5.0}], "max_duration_s": 1}))
        return path

    met, out = earlier_run(0.01), tmp_path / "verdict.json"
    assert dominance.main(["--verdict-of", str(met), "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert (written["rows"], written["all_targets_met"], [v["workload"] for v in written["verdict"]]) == (
        json.loads(met.read_text())["rows"], True, ["x"])
    assert "verdict: laps meets every target" in capsys.readouterr().out
    assert dominance.main(["--verdict-of", str(earlier_run(0.0115))]) == 1
    said = capsys.readouterr().out
    assert "verdict: laps misses at least one target" in said
    assert ("short-P90 misses (each TTFT as a client sees it: simulated + the gateway's 0.56 ms):\n"
            "  x at 1.00× short P90: laps 12.06 / target 12.00 ms (twice the floor; least_load 10.56 ms)\n") in said
    assert dominance.main(["--verdict-of", str(met), "--out", "/dev/full"]) == 1  # the tables print, then the write fails
    assert capsys.readouterr().err.endswith(": cannot write /dev/full: No space left on device\n")


def test_a_json_to_standard_output_is_the_only_thing_there(tmp_path, capfd):
    rows = [{"workload": "x", "pd": False, "policy": policy, "load": 5.0, "slo_violation_rate": 0.0,
             "length_slo_violation_rate": 0.0, "short_ttft_p90_s": 0.01, "short_floor_s": 0.006} for policy in ("laps", "least_load")]
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"rows": rows, "verdict": [{"workload": "x", "saturation_load": 5.0}], "max_duration_s": 1}))
    dominance.main(["--verdict-of", str(earlier), "--out", "/dev/stdout"])
    out, err = capfd.readouterr()
    assert json.loads(out)["rows"] == rows  # one JSON document: the tables went to standard error
    assert "verdict: laps" in err and "wrote /dev/stdout" in err


def test_a_stopped_run_keeps_what_it_wrote_and_a_file_it_did_not_make(tmp_path, capsys):
    parser = dominance.doc_parser(dominance.__doc__, prog="bench")
    made = dominance.claim_out(parser, tmp_path / "new" / "deeper" / "made.json")  # the file and both folders made
    assert made == dominance.Claim(tmp_path / "new" / "deeper" / "made.json", (tmp_path / "new" / "deeper", tmp_path / "new"))
    theirs = tmp_path / "theirs.json"
    theirs.touch()
    assert dominance.claim_out(parser, theirs) == dominance.Claim()
    partial = dominance.claim_out(parser, tmp_path / "new2" / "partial.json")
    assert dominance.stopped(parser, made, KeyboardInterrupt()) == 130
    assert dominance.stopped(parser, dominance.Claim(), KeyboardInterrupt()) == 130
    assert dominance.stopped(parser, partial, KeyboardInterrupt(), "partial.json holds mixed") == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new2", "theirs.json"]  # "new" and what it held taken back
    assert (tmp_path / "new2" / "partial.json").exists()
    assert capsys.readouterr().err.splitlines() == ["bench: interrupted; nothing written"] * 2 + [
        "bench: interrupted; partial.json holds mixed"]
    with pytest.raises(ValueError, match="bad row"):
        dominance.stopped(parser, dominance.Claim(), ValueError("bad row"))


def test_an_out_is_refused_before_the_run_as_laps_simulate_refuses_it(tmp_path, capsys):
    parser = dominance.doc_parser(dominance.__doc__, prog="bench")
    (tmp_path / "p.json.partial").mkdir()  # in the way of the file the JSON is written as first
    (tmp_path / "dot-link.json").symlink_to(f"{tmp_path / 'later'}/.")
    for out, says in ((tmp_path / "p.json", "cannot be written (p.json.partial, which it is written as first, is a folder)"),
                      (tmp_path / "dot-link.json", f"a link to a folder ({tmp_path / 'later'}/.), not to a file")):
        with pytest.raises(SystemExit) as exit_:
            dominance.claim_out(parser, out)
        assert exit_.value.code == 2 and capsys.readouterr().err.endswith(f"bench: error: --out {out}: {says}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dot-link.json", "p.json.partial"]


def test_a_sweep_whose_plots_could_not_be_written_is_refused_before_it_runs(tmp_path, capsys):
    parser = dominance.doc_parser(dominance.__doc__, prog="bench")
    out = tmp_path / ("c" * (os.pathconf(tmp_path, "PC_NAME_MAX") - 18))  # c..c_mixed.png.partial fits, c..c_mixed_pd.png.partial not
    plots = [dominance.sweep_plot(out, "mixed", False), dominance.sweep_plot(out, "mixed", True)]
    with pytest.raises(SystemExit) as exit_:
        dominance.claim_out(parser, out, plots)
    assert exit_.value.code == 2 and f"--out's plot {plots[1]}: cannot be written" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert dominance.sweep_plot(Path("runs/d.json"), "docs", True) == Path("runs/d_docs_pd.png")


def test_a_claim_takes_back_only_what_is_still_empty(tmp_path):
    parser = dominance.doc_parser(dominance.__doc__, prog="bench")
    claim = dominance.claim_out(parser, tmp_path / "a" / "b" / "d.json")
    (tmp_path / "a" / "mine.txt").write_text("kept\n")  # something of the user's put in a folder the claim made
    claim.release()
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["a", "a/mine.txt"]
    claim = dominance.claim_out(parser, tmp_path / "c" / "d.json")
    (tmp_path / "c" / "d.json").write_text("{}")  # written to: it and its folder stay
    claim.release()
    assert (tmp_path / "c" / "d.json").read_text() == "{}"


def test_an_out_that_cannot_be_made_leaves_no_folder_behind(tmp_path, capsys):
    parser = dominance.doc_parser(dominance.__doc__, prog="bench")
    out = tmp_path / "new" / ("n" * (os.pathconf(tmp_path, "PC_NAME_MAX") - len(".json") - 2) + ".json")  # .partial: too long
    with pytest.raises(SystemExit) as exit_:
        dominance.claim_out(parser, out)
    assert exit_.value.code == 2 and "cannot be written (a name longer than" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_misses_are_printed_under_their_own_headings(capsys):
    rows = [row("laps", 100, 100, 0.02, short=0.03), row("least_load", 100, 100, 0.0, short=0.02)]
    dominance.print_verdicts([dominance.verdict(rows, "w", 100.0)], dominance.Console(width=200))
    said = capsys.readouterr().out
    assert said[said.index("short-P90 misses"):said.index("verdict:")].splitlines() == [
        "short-P90 misses (each TTFT as a client sees it: simulated + the gateway's 0.56 ms):",
        "  w at 1.00× short P90: laps 30.56 / target 10.28 ms (half the baseline's; least_load 20.56 ms)",
        "worse than the best baseline by more than 0.5 points:",
        "  w at 1.00× (load 100): laps 2.0% (length-aware 2.0%) vs best 0.0% (least_load; length-aware 0.0%)"]


def test_the_json_goes_through_a_pipe_as_it_is_and_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch, capsys):
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as pipe:
        dominance.write_json(Path(f"/dev/fd/{write_end}"), dominance.dominance_json(1.0, [], [], True))  # "pipe:[...]" in /proc
        os.close(write_end)
        assert json.loads(pipe.read())["all_targets_met"] is True
    log = tmp_path / "log.txt"  # stdout redirected with >>: appended to, not renamed over
    log.write_text("earlier line\n")
    with open(log, "a") as f:
        dominance.write_json(Path(f"/dev/fd/{f.fileno()}"), dominance.dominance_json(1.0, [], [], True))
    assert log.read_text().startswith("earlier line\n{") and sorted(p.name for p in tmp_path.iterdir()) == ["log.txt"]
    log.unlink()
    out = tmp_path / "d.json"

    def full(self, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "replace", full)
    parser = dominance.doc_parser(dominance.__doc__, prog="bench")
    for claim, left in ((dominance.Claim(), ["d.json"]), (dominance.Claim(out), [])):
        out.touch()  # as claim_out leaves it
        assert dominance.save(parser, dominance.Console(), out, {}, claim) is False
        assert sorted(p.name for p in tmp_path.iterdir()) == left  # and never d.json.partial
        assert capsys.readouterr().err == f"bench: cannot write {out}: No space left on device\n"


def test_a_sweep_whose_json_cannot_be_written_is_one_line_and_leaves_no_empty_file_nor_a_link_removed(tmp_path, monkeypatch, capsys):
    rows = [row("laps", 5.0, 5.0, 0.0), row("least_load", 5.0, 5.0, 0.0)]
    monkeypatch.setattr(dominance, "simulation_pool", lambda jobs: contextlib.nullcontext())
    monkeypatch.setattr(dominance, "sweep", lambda workload, *args: (rows, dominance.verdict(rows, workload, 5.0)))
    monkeypatch.setattr(dominance, "plot", lambda *args: None)

    def full(self, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "replace", full)
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "later" / "d.json")  # claim_out makes the empty file at its target
    assert dominance.main(["--workloads", "mixed", "--out", str(link)]) == 1
    assert capsys.readouterr().err.endswith(f": cannot write {link}: No space left on device\n")
    assert link.is_symlink() and not (tmp_path / "later").exists()  # the link as it was; no folder, empty file or .partial


def test_a_sweep_whose_plot_cannot_be_written_names_the_plot_and_leaves_no_empty_json(tmp_path, monkeypatch, capsys):
    rows = [row("laps", 5.0, 5.0, 0.0), row("least_load", 5.0, 5.0, 0.0)]
    monkeypatch.setattr(dominance, "simulation_pool", lambda jobs: contextlib.nullcontext())
    monkeypatch.setattr(dominance, "sweep", lambda workload, *args: (rows, dominance.verdict(rows, workload, 5.0)))

    def too_long(*args):
        raise OSError(36, "File name too long")

    monkeypatch.setattr(dominance, "plot", too_long)
    (tmp_path / "d.json.partial").write_text("mine\n")  # a file of the user's beside --out: the check leaves it
    assert dominance.main(["--workloads", "mixed", "--out", str(tmp_path / "d.json")]) == 1
    assert capsys.readouterr().err.endswith(f": cannot write {tmp_path / 'd_mixed.png'}: File name too long\n")
    assert [p.name for p in tmp_path.iterdir()] == ["d.json.partial"]


def test_an_out_in_a_loop_of_links_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "a.json").symlink_to(tmp_path / "b.json")
    (tmp_path / "b.json").symlink_to(tmp_path / "a.json")
    with pytest.raises(SystemExit) as exit_:
        dominance.main(["--workloads", "mixed", "--out", str(tmp_path / "a.json")])
    assert exit_.value.code == 2 and "--out " + str(tmp_path / "a.json") + ": cannot be written (Symlink loop" in capsys.readouterr().err


def test_an_out_whose_file_beside_it_cannot_be_made_is_refused_before_the_run(tmp_path, capsys):
    out = tmp_path / ("n" * (os.pathconf(tmp_path, "PC_NAME_MAX") - len(".json") - 2) + ".json")  # .partial: too long
    with pytest.raises(SystemExit) as exit_:
        dominance.main(["--workloads", "mixed", "--out", str(out)])
    assert exit_.value.code == 2 and ".json.partial, which it is written as first, is longer than" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
