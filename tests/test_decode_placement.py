"""Decode-side placement (policies/decode_placement.py): least load, the aligned band rule and its guards."""

from __future__ import annotations

import pytest

from laps.config import SchedulingConfig, parse_config
from laps.tokenizer import load_tokenizer
from loadgen.runner import Arrival
from loadgen.virtual import VirtualRun
from loadgen.workloads import Conversation, Turn
from policies.decode_placement import (
    AlignedPlacement,
    AlignedPlacementConfig,
    LeastLoadPlacement,
    PlacementScheduler,
)
from policies.registry import make_decode_placement, make_scheduler
from policies.types import EngineView, RequestView


def views(*loads: int, healthy: tuple[bool, ...] | None = None) -> list[EngineView]:
    healthy = healthy or (True,) * len(loads)
    return [EngineView(f"e{i}", "short", ok, n) for i, (n, ok) in enumerate(zip(loads, healthy))]


class Cluster:
    """Placement plus the in-flight counts a runner would keep in the views."""

    def __init__(self, placement, engines: int = 2) -> None:
        self.placement = placement
        self.load = {f"e{i}": 0 for i in range(engines)}

    def pick(self, rid: str, context: int, now: float = 0.0) -> str | None:
        chosen = self.placement.pick(rid, context, views(*self.load.values()), now)
        if chosen is not None:
            self.load[chosen] += 1
        return chosen

    def done(self, rid: str, engine: str, now: float = 0.0) -> None:
        self.placement.on_done(rid, now)
        self.load[engine] -= 1


def test_least_load_picks_fewest_in_flight_then_fewest_prompt_tokens_then_first():
    p = LeastLoadPlacement()
    engines = [EngineView("a", "short", True, 3, 10), EngineView("b", "short", True, 2, 900), EngineView("c", "short", True, 2, 100)]
    assert p.pick("r", 50, engines, 0.0) == "c"
    assert p.pick("r", 50, views(1, 1), 0.0) == "e0"
    assert p.pick("r", 50, views(0, 5, healthy=(False, True)), 0.0) == "e1"
    assert p.pick("r", 50, views(0, healthy=(False,)), 0.0) is None


def test_aligned_groups_long_and_short_requests_by_padding_waste():
    c = Cluster(AlignedPlacement())
    assert c.pick("s1", 100) == "e0"  # both empty: waste 0, tie on load -> first
    assert c.pick("l1", 5000) == "e1"  # e0 would waste 1·(5000 − 100); empty e1 wastes 0
    assert c.pick("s2", 120) == "e0"  # e0: 1·20; e1: 5000 − 120
    assert c.pick("l2", 4000) == "e1"  # e0: 2·(4000 − 120); e1: 5000 − 4000
    p = c.placement
    assert p.waste_tokens("e0", 50, 0.0) == 70 and p.waste_tokens("e1", 6000, 0.0) == 2 * 1000
    assert p.band_placements_total == 4 and p.guarded_placements_total == 0


def test_context_estimate_grows_from_the_first_token_at_the_assumed_pace():
    p = AlignedPlacement(AlignedPlacementConfig(tpot_estimate_ms=20.0))
    p.pick("a", 100, views(0), 0.0)
    assert p.context_tokens("a", 10.0) == 100  # no token yet: still prefilling or queued
    p.on_progress("a", 1, 1.0)
    assert p.context_tokens("a", 3.0) == pytest.approx(100 + 1 + 2.0 / 0.02)
    p.on_progress("a", 31, 2.0)  # a progress report resets the estimate to the reported count
    assert p.context_tokens("a", 2.0) == 131
    assert p.longest_tokens("e0", 2.5) == pytest.approx(131 + 25)
    p.pick("b", 400, views(1), 2.5)  # not started: counts at its full prompt, without growth
    assert p.longest_tokens("e0", 4.0) == 400  # "a" is at 131 + 100
    assert p.longest_tokens("e0", 8.0) == pytest.approx(131 + 300)  # "a" passed "b"
    p.on_done("a", 8.0)
    assert p.longest_tokens("e0", 8.0) == 400


def test_balance_guard_overrides_the_band():
    config = AlignedPlacementConfig(balance_slack_requests=2, balance_slack_ratio=0.5)
    p = AlignedPlacement(config)
    p.pick("long", 8000, views(0, 0), 0.0)  # -> e0
    p.pick("short", 100, views(1, 0), 0.0)  # -> e1
    # e0 holds 8,000-token contexts; a 7,900-token request belongs there while e0 is within the slack:
    # least = 4 -> cap = 4 + max(2, 2) = 6
    assert p.pick("x", 7900, views(6, 4), 0.0) == "e0"
    assert p.pick("y", 7900, views(7, 4), 0.0) == "e1"  # 7 > 6: only e1 is eligible
    assert p.band_placements_total == 4


def test_kv_guard_keeps_long_requests_off_an_engine_far_above_the_least_kv():
    config = AlignedPlacementConfig(kv_slack_tokens=1000, kv_slack_ratio=0.0, balance_slack_requests=100)
    p = AlignedPlacement(config)
    p.pick("long", 8000, views(0, 0), 0.0)  # e0
    p.pick("short", 100, views(1, 0), 0.0)  # e1
    assert p.kv_tokens("e0", 0.0) == 8000 and p.kv_tokens("e1", 0.0) == 100
    assert p.pick("a", 7000, views(1, 1), 0.0) == "e1"  # e0: 8,000 > 100 + 1,000
    p.on_progress("long", 1, 1.0)
    assert p.kv_tokens("e0", 2.0) == pytest.approx(8001 + 50)
    p.on_done("long", 2.0)
    assert p.kv_tokens("e0", 2.0) == 0 and p.kv_tokens("e1", 2.0) == 7100


def test_starvation_guard_excludes_an_engine_holding_a_request_without_a_token():
    config = AlignedPlacementConfig(tpot_slo_ms=100.0, starvation_tokens=50.0)  # starvation_s = 5
    assert config.starvation_s == 5.0
    p = AlignedPlacement(config)
    p.pick("long", 8000, views(0, 0), 0.0)  # e0
    p.pick("short", 100, views(1, 0), 0.0)  # e1
    assert p.pick("a", 7000, views(1, 1), 5.0) == "e0"  # waited exactly 5 s: not yet starving
    assert p.starving("e0", 5.01) and p.starving("e1", 5.01)
    p.on_progress("short", 1, 5.0)
    assert not p.starving("e1", 5.01)
    assert p.pick("b", 7000, views(2, 1), 5.01) == "e1"  # e0 is starving: the band is ignored
    p.on_progress("b", 1, 5.02)
    p.on_done("long", 5.02)  # e0's oldest waiting request is now "a", picked at 5.0
    assert not p.starving("e0", 5.02)
    assert p.pick("c", 7000, views(1, 2), 5.02) == "e0"


def test_starvation_guard_counts_tokens_behind_the_slo_pace_and_falls_back_to_least_load():
    p = AlignedPlacement(AlignedPlacementConfig(tpot_slo_ms=100.0, starvation_tokens=50.0))
    p.pick("a", 1000, views(0, 0), 0.0)  # e0
    p.pick("b", 1000, views(1, 0), 0.0)  # e1
    p.on_progress("a", 1, 1.0)
    p.on_progress("b", 1, 1.0)
    p.on_progress("a", 11, 7.0)  # paced 60 tokens since the first, produced 10: 50 behind, not more
    assert not p.starving("e0", 7.0)
    p.on_progress("a", 10 + 1, 7.2)  # 62 paced, 10 produced: 52 behind
    p.on_progress("b", 1 + 9, 7.2)  # 62 paced, 9 produced
    assert p.starving("e0", 7.2) and p.starving("e1", 7.2)
    assert p.pick("c", 1000, views(3, 2), 7.2) == "e1"  # nobody eligible: least loaded
    assert p.guarded_placements_total == 1
    p.on_progress("a", 70, 7.3)  # caught up
    assert not p.starving("e0", 7.3)


def test_bad_input_and_unknown_rids():
    p = AlignedPlacement()
    with pytest.raises(ValueError, match="context_tokens"):
        p.pick("a", -1, views(0), 0.0)
    p.pick("a", 10, views(0), 0.0)
    with pytest.raises(ValueError, match="already placed"):
        p.pick("a", 10, views(1), 0.0)
    p.on_progress("nope", 3, 1.0)
    p.on_done("nope", 1.0)
    assert p.pick("b", 10, views(0, healthy=(False,)), 0.0) is None
    with pytest.raises(ValueError):
        AlignedPlacementConfig(tpot_estimate_ms=0)


def test_factory_and_config_keys():
    assert isinstance(make_decode_placement(SchedulingConfig()), LeastLoadPlacement)
    aligned = make_decode_placement(SchedulingConfig(decode_placement="aligned", aligned={"balance_slack_requests": 3}))
    assert isinstance(aligned, AlignedPlacement) and aligned.config.balance_slack_requests == 3
    with pytest.raises(ValueError, match="decode_placement"):
        SchedulingConfig(decode_placement="round_robin")


def test_aligned_policy_dispatches_at_once_and_forwards_progress():
    scheduler = make_scheduler(SchedulingConfig(policy="aligned"))
    assert isinstance(scheduler, PlacementScheduler)
    scheduler.submit(RequestView("s", 100), 0.0)
    scheduler.submit(RequestView("l", 6000), 0.0)
    decision = scheduler.decide(views(0, 0), 0.0)
    assert [(d.engine_id, d.rids) for d in decision.dispatches] == [("e0", ("s",)), ("e1", ("l",))]
    scheduler.on_first_token("s", "e0", 1.0, None)
    placement = scheduler.placement
    assert placement.context_tokens("s", 1.0) == 101
    scheduler.on_complete("s", "e0", 2.0)
    assert placement.longest_tokens("e0", 2.0) == 0
    assert scheduler.stats() == {"queued_requests": 0, "band_placements_total": 2.0, "guarded_placements_total": 0.0}


def test_aligned_policy_runs_in_the_virtual_time_simulator():
    roles = {"chat": {"pool": "short", "flags": {}}}
    config = parse_config({"roles": roles, "engines": [{"name": f"e{i}", "role": "chat", "gpus": [i]} for i in range(2)],
                           "scheduling": {"policy": "aligned"}})
    run = VirtualRun(config, load_tokenizer(), ignore_eos=True)
    placement = run.scheduler.placement
    picks: dict[str, str] = {}
    pick = placement.pick

    def spy(rid, context_tokens, engines, now, **options):
        picks[rid] = pick(rid, context_tokens, engines, now, **options)
        return picks[rid]

    placement.pick = spy
    texts = {"s0": "Hi there.", "l0": "harbour ferry " * 1500, "s1": "Hello again.", "l1": "ferry harbour " * 1400}
    plan = [Arrival(0.01 * i, Conversation(cid, "test", (Turn(text, 200),), start_s=0.01 * i), ())
            for i, (cid, text) in enumerate(texts.items())]
    records = run.run(plan, duration_s=60)
    assert len(records) == 4 and all(r.ok for r in records)
    assert picks["s0/0"] == picks["s1/0"] != picks["l0/0"] == picks["l1/0"]  # the long ones share an engine
    assert placement.band_placements_total == 4
    assert [placement.kv_tokens(e, run.now) for e in ("e0", "e1")] == pytest.approx([0, 0], abs=1e-6)  # all reported done


def test_stale_heap_entries_stay_bounded_in_a_long_run():
    p = AlignedPlacement()
    p.pick("keep", 10, views(0), 0.0)
    for i in range(5000):
        p.pick(f"r{i}", 100 + i % 7, views(1), float(i))
        p.on_progress(f"r{i}", 1, i + 0.5)
        p.on_progress(f"r{i}", 2, i + 0.6)
        p.on_done(f"r{i}", i + 0.9)
    assert p.longest_tokens("e0", 5000.0) == 10
    assert len(p._grow_heap["e0"]) <= 2 * 1 + 16 + 1 and len(p._still_heap["e0"]) <= 2 * 1 + 16 + 1


def test_a_non_streaming_request_waiting_for_its_whole_answer_does_not_starve_its_engine():
    # A non-streaming request reports its first token with its last; 6 s without one is no sign of starvation
    # (starvation_s is 5 s), while a streaming one that long without a token does starve its engine.
    p = AlignedPlacement()
    assert [p.pick(rid, 100, views(0, 0), 0.0, reports_progress=False) for rid in ("a", "b")] == ["e0", "e0"]
    assert p.starving("e0", 6.0) is False
    assert p.pick("c", 100, views(0, 0), 6.0) == "e0"  # a tie on waste and load: the first engine, not starving
    assert p.starving("e0", 11.5) is True  # c streams: 5.5 s after its pick without a token
    p.on_progress("a", 1, 12.0)  # a's whole answer is in: not lagging behind a paced stream either
    p.on_done("a", 12.0)
    assert p.starving("e0", 12.0) is True and p.pick("d", 100, views(0, 0), 12.0) == "e1"


def test_the_aligned_policy_tells_the_placement_which_requests_stream():
    scheduler = make_scheduler(SchedulingConfig(policy="aligned"))
    for rid, stream in (("quiet", False), ("loud", True)):
        scheduler.submit(RequestView(rid, 100, stream=stream), 0.0)
    scheduler.decide(views(0), 0.0)
    assert scheduler.placement._unstarted["e0"] == {"loud": 0.0}
