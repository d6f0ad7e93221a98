"""bench/held_out.py's "laps worse" marks on scripted rows, and its refusal of a dataset that is not a trace file."""

import argparse
import json
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "held_out.py"
_spec = importlib.util.spec_from_file_location("held_out", BENCH)
held_out = sys.modules["held_out"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(held_out)


def row(policy, load, fixed, length):
    return {"policy": policy, "load": load, "slo_violation_rate": fixed, "length_slo_violation_rate": length}


def test_laps_is_marked_worse_only_past_the_best_baseline_plus_half_a_point_on_each_objective():
    rows = [row("laps", 9, 0.2025, 0.0065), row("least_load", 9, 0.3365, 0.0845), row("least_load+spf", 9, 0.28, 0.0185),
            row("laps", 12, 0.272, 0.0505), row("least_load+spf", 12, 0.34, 0.0335), row("cache_aware", 12, 0.36, 0.10),
            row("laps", 15, 0.30, 0.0385), row("least_load+spf", 15, 0.296, 0.0335)]
    assert held_out.worse_than_best(rows, 9) == []
    assert held_out.worse_than_best(rows, 12) == ["length-aware"]  # 5.05% against 3.35%: 1.7 points
    assert held_out.worse_than_best(rows, 15) == []  # 0.4 and exactly 0.5 points over: within the margin


def test_the_control_is_not_a_baseline_laps_must_beat():
    rows = [row("laps", 9, 0.20, 0.01), row("least_load+spf", 9, 0.25, 0.02), row(held_out.CONTROL, 9, 0.10, 0.001)]
    assert held_out.worse_than_best(rows, 9) == []


@pytest.mark.parametrize(("text", "says"), [("mixed", "expected FORMAT:PATH"), ("csv:/x.csv", "expected FORMAT:PATH"),
                                            ("azure:/no/such.csv", "no such file"),
                                            ("lengths:", "expected FORMAT:PATH")])
def test_only_a_trace_file_that_exists_is_taken(text, says):
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        held_out.trace(text)


def test_a_file_its_reader_refuses_stops_the_bench_before_any_simulation(tmp_path, capsys):
    trace_file = tmp_path / "lengths.csv"
    trace_file.write_text("a,b\n1,2\n")
    out = tmp_path / "out.json"
    assert held_out.main(["--dataset", f"lengths:{trace_file}", "--loads", "1", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"held_out.py: error: {trace_file} line 1: not a token-count CSV: expected the "
                                       "columns num_prefill_tokens,num_decode_tokens or input_tokens,output_tokens "
                                       "(header: a,b)\n")
    assert not out.exists()


def test_burstiness_of_a_timed_trace_is_refused_before_any_simulation(tmp_path, capsys):
    trace_file = Path(__file__).resolve().parent.parent / "loadgen" / "data" / "azure_llm_2023_conv.csv"
    out = tmp_path / "out.json"
    assert held_out.main(["--dataset", f"azure:{trace_file}", "--loads", "3", "--burstiness", "0.25", "--out", str(out)]) == 2
    assert capsys.readouterr().err.endswith(f"held_out.py: error: --burstiness: azure:{trace_file} is a timed trace, "
                                            "replayed at its own times\n")
    assert not out.exists()


def test_burstiness_reaches_every_point_and_the_json(tmp_path, monkeypatch):
    """Each simulated point gets the --burstiness given; the JSON records it (a fake simulation stands in)."""
    trace_file = tmp_path / "lengths.csv"
    trace_file.write_text("input_tokens,output_tokens\n100,10\n2000,20\n")
    jobs = []

    def fake_simulate_all(n_jobs, fn, calls, console):
        jobs.extend(calls)
        return [{"policy": c[1], "load": c[2], "requests": 1, "slo_violation_rate": 0.0, "length_slo_violation_rate": 0.0,
                 "short_ttft_p90_s": 0.01, "ttft_p90_s": 0.02, "tpot_p50_s": 0.005} for c in calls]

    monkeypatch.setattr(held_out, "simulate_all", fake_simulate_all)
    out = tmp_path / "out.json"
    assert held_out.main(["--dataset", f"lengths:{trace_file}", "--loads", "5", "--burstiness", "0.25",
                          "--policies", "laps", "least_load", "--out", str(out)]) == 0
    assert jobs == [(f"lengths:{trace_file}", "laps", 5.0, 3000, 0, 0.25),
                    (f"lengths:{trace_file}", "least_load", 5.0, 3000, 0, 0.25)]
    assert json.loads(out.read_text())["burstiness"] == 0.25
