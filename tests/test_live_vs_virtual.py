"""The live gateway with engine processes and the virtual-time simulator agree on TTFT (a small bench/live_vs_virtual.py)."""

from __future__ import annotations

import asyncio
import random

import pytest

from laps.config import DEFAULT_CONFIG_PATH, load_config
from laps.demo import serving
from laps.tokenizer import load_tokenizer
from loadgen.agreement import compare, serving_latency
from loadgen.report import build_report
from loadgen.runner import run_loadgen
from loadgen.simulate import simulate
from loadgen.workloads import build_workload

DURATION_S = 24.0
RATE = 3.0
# The live P90 over the ~120 requests of this test is about their 12th-longest TTFT, on a step between ~40 and ~52 ms
# long prefills, so a few ms move it. On a quiet 2-core machine (2026-12-04, two runs) the virtual run with both parts
# of the measured serving latency (a fixed ~4 ms and 1.6-2.0 ms per 1,000 new prompt tokens) put P50 7-8% and P90 -5% and
# +1% off the live one; with the fixed part alone P90 was 14-18% under it (long first turns' tokenizing uncharged).
TOLERANCE_PCT = 20
# The live stack's idle overhead, measured before and after the live run, may move by this much (seconds) or this
# share of itself, whichever is more; past that, something else took the machine's CPU during the run (live TTFT p50
# came out 22% above the virtual one once in a full suite, and within 13% on every rerun), and the run is done again.
# Full garbage collections (up to 82 ms in the gateway, 64 ms in this process) were what moved the live P90 until every
# process froze its start-up heap (laps.heap; run_loadgen freezes this one for its run): 50.4-56.6 ms before, 42.7-45.7
# after, on the same machine.
OVERHEAD_DRIFT_S = 1e-3
OVERHEAD_DRIFT_SHARE = 0.5
# A comparison outside the tolerance is also done again, up to ATTEMPTS runs in all: on a shared 2-core machine the
# idle overhead itself moved between 9 and 22 ms from one measurement to the next (2026-12-07; ~4 ms on 2026-12-04),
# and commit b60dbf0, which had passed this test in CI, failed it in 2 runs of 2 there that day (P50 +23%); one run in
# two disagreed (4 runs: P90 +20%, P50 +36%, two within 13%), the virtual run slower each time: the idle probes paid
# more than the loaded run did. A disagreement of the engine model or the gateway is the same on every run; the test
# fails when every run disagrees (one in 2^5 on that machine, each failed run ~40 s more).
ATTEMPTS = 5


def _steady(before_s: float, after_s: float) -> bool:
    """Whether the idle overhead stayed put across the live run (:data:`OVERHEAD_DRIFT_S`, :data:`OVERHEAD_DRIFT_SHARE`)."""
    return abs(after_s - before_s) <= max(OVERHEAD_DRIFT_S, OVERHEAD_DRIFT_SHARE * min(before_s, after_s))


def test_overhead_drift_rule():
    assert _steady(0.0020, 0.0029)  # within 1 ms
    assert _steady(0.0040, 0.0059)  # within half of 4 ms
    assert not _steady(0.0020, 0.0031)
    assert not _steady(0.0060, 0.0095)


def _disagreements(config, tok, workload) -> list[str]:
    """One live run between two idle-overhead measurements and its virtual run: the comparisons outside the tolerance
    (empty: they agree), or one saying the overhead moved (:func:`_steady`)."""
    with serving(DEFAULT_CONFIG_PATH) as url:
        before = asyncio.run(serving_latency(url, config, tok, count=12))
        live = asyncio.run(run_loadgen(url, workload(), duration_s=DURATION_S, seed=0, rate=RATE,
                                       extra_body={"ignore_eos": True}))  # pytest's heap frozen meanwhile
        after = asyncio.run(serving_latency(url, config, tok, count=12))
    drift = (f"idle overhead {1e3 * before.fixed_s:.2f} ms + {1e3 * before.per_1k_s:.2f} ms per 1k new prompt tokens before the "
             f"live run, {1e3 * after.fixed_s:.2f} + {1e3 * after.per_1k_s:.2f} ms after")
    if not _steady(before.fixed_s, after.fixed_s):
        return [f"the machine was busy: {drift}"]
    fixed_s, per_1k_s = (before.fixed_s + after.fixed_s) / 2, (before.per_1k_s + after.per_1k_s) / 2
    virtual = simulate(config, workload(), duration_s=DURATION_S, seed=0, rate=RATE, ignore_eos=True,
                       serving_latency_s=fixed_s, serving_latency_per_1k_s=per_1k_s, tokenizer=tok)
    assert 0 < fixed_s < 0.05 and 0 <= per_1k_s < 0.02
    assert abs(len(live) - len(virtual)) <= 3  # turns starting near the end may fall either side of it
    assert all(r.ok for r in live + virtual)
    rows = {(r["group"], r["metric"], r["stat"]): r for r in compare(build_report(live, slo_ttft_s=0.4),
                                                                      build_report(virtual, slo_ttft_s=0.4))}
    checked = [rows[("all", "ttft_s", "p50")], rows[("all", "ttft_s", "p90")], rows[("all", "tpot_s", "p50")]]
    return [f"{r['metric']} {r['stat']}: live {1e3 * r['live_s']:.1f} ms, virtual {1e3 * r['virtual_s']:.1f} ms "
            f"({r['diff_pct']:+.0f}%; {drift})" for r in checked if abs(r["diff_pct"]) > TOLERANCE_PCT]


def test_live_and_virtual_ttft_agree_at_moderate_load():
    config = load_config(DEFAULT_CONFIG_PATH)
    tok = load_tokenizer(config.model.path)

    def workload():
        return build_workload("mixed", random.Random("workload/0"), tokenizer=tok)

    runs = []
    for _ in range(ATTEMPTS):
        runs.append(_disagreements(config, tok, workload))
        if not runs[-1]:
            return
    pytest.fail(f"live and virtual disagree beyond {TOLERANCE_PCT}% on every one of {ATTEMPTS} runs: {runs}")
