"""bench/violation_floor.py: the lower bound on TTFT SLO violations, on scripted arrivals with exact counts."""

import importlib.util
import sys
from pathlib import Path

import pytest

from engines.sim.latency import make_latency_model

BENCH = Path(__file__).resolve().parent.parent / "bench" / "violation_floor.py"
_spec = importlib.util.spec_from_file_location("violation_floor", BENCH)
floor = sys.modules["violation_floor"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(floor)


def test_a_burst_past_the_engines_capacity_forces_its_excess_to_miss():
    # Ten 0.1-s prefills at t = 0 on 2 engines with 0.4 s each: 0.8 s of engine time for 1.0 s of work, so 2 miss.
    assert floor.violation_floor([0.0] * 10, [0.1] * 10, slo_ttft_s=0.4, engines=2) == 2
    # The largest go first: one 0.3-s request covers the 0.2-s excess alone.
    assert floor.violation_floor([0.0] * 8, [0.3] + [0.1] * 7, slo_ttft_s=0.4, engines=2) == 1
    # Within capacity nothing must miss.
    assert floor.violation_floor([0.0] * 8, [0.1] * 8, slo_ttft_s=0.4, engines=2) == 0
    assert floor.violation_floor([], [], slo_ttft_s=0.4, engines=2) == 0
    # A prefill longer than the objective misses on any number of engines (one runs on one engine); the rest as before.
    assert floor.violation_floor([0.0, 0.0], [0.5, 0.1], slo_ttft_s=0.4, engines=8) == 1
    assert floor.violation_floor([0.0] * 11, [0.5] + [0.1] * 10, slo_ttft_s=0.4, engines=2) == 3


def test_disjoint_bursts_add_up_and_spread_arrivals_do_not_overlap_windows():
    burst = [0.1] * 10
    assert floor.violation_floor([0.0] * 10 + [5.0] * 10, burst + burst, slo_ttft_s=0.4, engines=2) == 4
    # The same work spread over 1 s: a window [0, b] gets 2·b s of engine time for the work due by b, never short.
    arrivals = [i / 10 for i in range(10)]
    assert floor.violation_floor(arrivals, [0.1] * 10, slo_ttft_s=0.4, engines=2) == 0
    # One engine, ten 0.1-s jobs every 0.05 s: work due by 0.85 s is 1.0 s, engine time 0.85 s: at least 2 miss
    # (the windows [0, 0.85] drop two; no grid window does better).
    arrivals = [i * 0.05 for i in range(10)]
    assert floor.violation_floor(arrivals, [0.1] * 10, slo_ttft_s=0.4, engines=1) == 2


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="arrivals but"):
        floor.violation_floor([0.0], [], slo_ttft_s=0.4, engines=1)
    with pytest.raises(ValueError, match="engines must be"):
        floor.violation_floor([0.0], [0.1], slo_ttft_s=0.4, engines=0)


def test_the_ideal_cache_counts_shared_blocks_generously_and_a_follow_ups_history():
    cache = floor.IdealPrefixCache()
    first = list(range(100))
    assert cache.arrive(first) == 16                       # nothing seen: the first block counted anyway
    assert cache.arrive(first[:40] + [999] * 60) == 48     # two blocks seen, the third counted in full
    assert cache.arrive(first) == 99                       # all seen: all but the last token
    assert cache.arrive([7] * 100, unshared_tail_tokens=10) == 90  # a follow-up: all before its new message
    assert cache.arrive([5] * 10) == 9                     # shorter than a block: at most all but one


def test_prefill_compute_is_the_compute_part_of_a_pass_without_padding():
    model = make_latency_model()
    eager = make_latency_model(prefill_graph=type(model.prefill_graph)("disabled"))
    for new, cached in ((1, 0), (300, 0), (2048, 5000)):
        pairs = new * cached + new * (new + 1) // 2
        pass_ = eager.breakdown_totals(1, new, pairs, 2 * new + cached, decode=False)
        assert model.prefill_compute_s(new, cached) == pytest.approx(pass_.compute_s, rel=1e-12)
        assert model.prefill_compute_s(new, cached) <= model.predict([(new, cached)])


def test_on_a_simulated_overload_the_floor_binds_and_stays_under_what_laps_achieved():
    """docs at 600 conv/s for 1.5 s (about 2.4 times least_load's saturation load): real schedules miss often, and the
    prefill compute alone already forces some misses; no schedule does better than the floor."""
    sys.path.insert(0, str(BENCH.parent))
    import dominance

    row = dominance.run_point("docs", "laps", 600.0, 1.5, seed=0)
    assert 0.05 < row["violation_floor"] <= row["slo_violation_rate"]
