"""The gateway's backlog scheduler: reservations against M, exact admission orders, release, config."""

from __future__ import annotations

import random

import pytest
import yaml

from laps.config import DEFAULT_CONFIG_PATH, ConfigError, parse_config
from policies.backlog_baselines import mc_sf_order
from policies.backlog_scheduler import BacklogConfig, BacklogScheduler, clip_to_budget
from policies.registry import make_scheduler
from policies.sorted_f import sorted_f_order
from policies.types import EngineView, RequestView


def view(rid: str, prompt: int, max_tokens: int | None, cls: str = "short", replies: tuple[int, ...] = ()) -> RequestView:
    return RequestView(rid, prompt, request_class=cls, max_tokens=max_tokens, reply_tokens=replies)


def engine(engine_id: str = "e0", capacity: int | None = 64, pool: str = "short", healthy: bool = True) -> EngineView:
    return EngineView(engine_id, pool, healthy, kv_capacity_tokens=capacity)


def oracle(policy: str, **kw) -> BacklogScheduler:
    return BacklogScheduler(BacklogConfig(policy=policy, predictor="max_tokens", **kw))


def dispatched(decision) -> list[str]:
    return [rid for d in decision.dispatches for rid in d.rids]


def example_3_1(scheduler: BacklogScheduler, big_at: int = 0) -> None:
    """Wang, Ye, Zhou Example 3.1: one (s=63, o=1) and 21 (s=1, o=2) requests, the big one at ``big_at``."""
    small = iter(range(21))
    for k in range(22):
        if k == big_at:
            scheduler.submit(view("big", 63, 1), 0.0)
        else:
            scheduler.submit(view(f"s{next(small)}", 1, 2), 0.0)


def drain(scheduler: BacklogScheduler, engines: list[EngineView]) -> list[list[str]]:
    """Admission rounds: decide, then complete everything admitted, until the backlog is empty."""
    rounds = []
    while True:
        got = scheduler.decide(engines, 0.0)
        if not got.dispatches:
            return rounds
        rounds.append(dispatched(got))
        for d in got.dispatches:
            for rid in d.rids:
                scheduler.on_complete(rid, d.engine_id, 0.0)


SMALL = [f"s{i}" for i in range(21)]


def test_sorted_f_admits_the_small_batch_first_on_example_3_1():
    s = oracle("sorted_f", solver="dp")
    example_3_1(s)
    assert drain(s, [engine(capacity=64)]) == [SMALL, ["big"]]


def test_mc_sf_admits_the_shortest_output_first_on_example_3_1():
    s = oracle("mc_sf")
    example_3_1(s, big_at=5)
    assert drain(s, [engine(capacity=64)]) == [["big"], SMALL]


def test_fcfs_admits_in_arrival_order_and_stops_at_the_first_misfit():
    s = oracle("fcfs")
    example_3_1(s, big_at=5)
    assert drain(s, [engine(capacity=64)]) == [SMALL[:5], ["big"], SMALL[5:]]


def test_sorted_f_order_equals_the_offline_order_on_a_backlog():
    rng = random.Random(3)
    lengths = [(rng.randint(1, 40), rng.randint(1, 30)) for _ in range(40)]
    s = oracle("sorted_f", solver="quantile")
    for i, (p, o) in enumerate(lengths):
        s.submit(view(f"r{i}", p, o), 0.0)
    members = list(s._waiting.values())
    got = [w.view.rid for w in s.order(("e0",), members, 200)]
    want = sorted_f_order([p for p, _ in lengths], [o for _, o in lengths], 200, "quantile")
    assert got == [f"r{i}" for i in want]
    mc = oracle("mc_sf")
    for i, (p, o) in enumerate(lengths):
        mc.submit(view(f"r{i}", p, o), 0.0)
    got = [w.view.rid for w in mc.order(("e0",), list(mc._waiting.values()), 200)]
    assert got == [f"r{i}" for i in mc_sf_order([o for _, o in lengths])]


@pytest.mark.parametrize("policy", ["sorted_f", "mc_sf", "fcfs"])
def test_reservations_never_exceed_m_on_any_engine(policy):
    rng = random.Random(policy)
    s = oracle(policy, memory_fraction=0.5)
    engines = [engine("a", 400), engine("b", 1000)]
    budget = {"a": 200, "b": 500}
    running: dict[str, tuple[str, int]] = {}
    for step in range(400):
        if rng.random() < 0.6:
            prompt, out = rng.randint(1, 300), rng.randint(1, 300)
            s.submit(view(f"r{step}", prompt, out), float(step))
        if running and rng.random() < 0.4:
            rid = rng.choice(sorted(running))
            s.on_complete(rid, running.pop(rid)[0], float(step))
        for d in s.decide(engines, float(step)).dispatches:
            (rid,) = d.rids
            w = s._held[rid]
            assert w[0] == d.engine_id
            running[rid] = w
        for e in ("a", "b"):
            held = sum(tokens for engine_id, tokens in running.values() if engine_id == e)
            assert held == s.reserved_tokens(e) <= budget[e]


def test_reservation_is_prompt_plus_prediction_and_is_released_on_completion():
    s = BacklogScheduler(BacklogConfig(policy="fcfs", predictor="history", prior_tokens=28, prior_weight=2))
    s.submit(view("a", 10, 500, replies=(10,)), 0.0)  # predicted 22
    s.submit(view("b", 20, 5), 0.0)  # predicted min(28, 5) = 5
    got = s.decide([engine(capacity=1000)], 0.0)
    assert dispatched(got) == ["a", "b"]
    assert s.reserved_tokens("e0") == 32 + 25
    s.on_complete("a", "e0", 1.0)
    assert s.reserved_tokens("e0") == 25
    s.cancel("b", 1.0)  # a dispatched request withdrawn also frees its room
    assert s.reserved_tokens("e0") == 0
    assert s.stats() == {"queued_requests": 0, "reserved_tokens": 0, "backlog_plans_total": 0}


def test_cancel_removes_a_waiting_request():
    s = oracle("fcfs")
    s.submit(view("a", 60, 4), 0.0)
    s.submit(view("b", 60, 4), 0.0)
    assert dispatched(s.decide([engine(capacity=64)], 0.0)) == ["a"]
    s.cancel("b", 0.0)
    s.on_complete("a", "e0", 1.0)
    assert s.decide([engine(capacity=64)], 1.0).dispatches == ()
    assert s.reserved_tokens("e0") == 0


def test_a_request_larger_than_m_runs_alone_with_its_reservation_clipped():
    s = oracle("fcfs")
    s.submit(view("small", 2, 2), 0.0)
    s.submit(view("huge", 100, 50), 0.0)
    assert dispatched(s.decide([engine(capacity=64)], 0.0)) == ["small"]
    assert dispatched(s.decide([engine(capacity=64)], 0.0)) == []
    s.on_complete("small", "e0", 0.0)
    assert dispatched(s.decide([engine(capacity=64)], 0.0)) == ["huge"]
    assert s.reserved_tokens("e0") == 64
    assert clip_to_budget(100, 50, 64) == (63, 1)
    assert clip_to_budget(10, 80, 64) == (10, 54)


def test_budget_comes_from_the_engine_then_the_default_else_no_limit():
    s = BacklogScheduler(BacklogConfig(memory_fraction=0.5, default_memory_tokens=300))
    assert s.budget(engine(capacity=1001)) == 500
    assert s.budget(engine(capacity=None)) == 300
    assert BacklogScheduler().budget(engine(capacity=None)) == float("inf")
    unlimited = oracle("sorted_f")
    for i in range(5):
        unlimited.submit(view(f"r{i}", 1000, 1000), 0.0)
    assert dispatched(unlimited.decide([engine(capacity=None)], 0.0)) == [f"r{i}" for i in range(5)]


def test_the_engine_with_most_room_of_the_class_pool_is_chosen():
    s = oracle("fcfs")
    engines = [engine("s0", 100), engine("s1", 200), engine("l0", 1000, pool="long")]
    s.submit(view("a", 50, 10), 0.0)
    s.submit(view("b", 50, 10), 0.0)
    s.submit(view("c", 50, 10), 0.0)
    s.submit(view("doc", 500, 10, cls="long"), 0.0)
    got = s.decide(engines, 0.0)
    assert [(d.engine_id, d.rids) for d in got.dispatches] == [
        ("s1", ("a",)), ("s1", ("b",)), ("s0", ("c",)), ("l0", ("doc",))]


def test_no_healthy_engine_rejects_the_backlog():
    s = oracle("fcfs")
    s.submit(view("a", 5, 5), 0.0)
    got = s.decide([engine(healthy=False)], 0.0)
    assert got.rejected == ("a",) and got.dispatches == ()


def test_sorted_f_replans_after_replan_every_dispatches_or_growth():
    s = oracle("sorted_f", replan_every=2, replan_growth=2.0)
    for i in range(4):
        s.submit(view(f"r{i}", 10, 10), 0.0)
    e = [engine(capacity=40)]
    assert len(dispatched(s.decide(e, 0.0))) == 2 and s.plans_total == 1
    s.on_complete("r0", "e0", 0.0)
    assert dispatched(s.decide(e, 0.0)) == ["r2"] and s.plans_total == 2  # 2 planned were dispatched
    for i in range(4, 8):  # backlog 1 -> 5: grown twofold
        s.submit(view(f"r{i}", 10, 10), 0.0)
    s.on_complete("r1", "e0", 0.0)
    s.decide(e, 0.0)
    assert s.plans_total == 3


def test_config_selects_the_backlog_scheduler():
    base = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    base["scheduling"] = {"policy": "backlog", "backlog": {"policy": "mc_sf", "memory_fraction": 0.9}}
    scheduler = make_scheduler(parse_config(base).scheduling)
    assert isinstance(scheduler, BacklogScheduler)
    assert (scheduler.config.policy, scheduler.config.memory_fraction) == ("mc_sf", 0.9)
    base["scheduling"]["backlog"] = {"policy": "sjf"}
    with pytest.raises(ConfigError, match="scheduling.backlog.policy"):
        parse_config(base)


def test_virtual_run_reads_m_from_the_engine_and_frees_every_reservation():
    from laps.tokenizer import load_tokenizer
    from loadgen.runner import plan_arrivals
    from loadgen.virtual import VirtualRun
    from loadgen.workloads import build_workload

    config = parse_config({
        "node": {"gpus": 1},
        "roles": {"small": {"pool": "short", "flags": {"max-total-tokens": 3000}}},
        "engines": [{"name": "e0", "kind": "sim", "role": "small", "gpus": [0]}],
        "scheduling": {"policy": "backlog", "backlog": {"policy": "sorted_f"}},
    })
    tok = load_tokenizer(None)
    run = VirtualRun(config, tok, request_timeout_s=1e9)
    assert run.registry["e0"].kv_capacity_tokens == 3000
    peak = []
    decide = run.scheduler.decide

    def watched(engines, now):
        decision = decide(engines, now)
        peak.append(run.scheduler.reserved_tokens("e0"))
        return decision

    run.scheduler.decide = watched
    submitted = []
    submit = run.scheduler.submit
    run.scheduler.submit = lambda request, now: (submitted.append(request), submit(request, now))
    plan = plan_arrivals(build_workload("hh-rlhf", random.Random(0), tokenizer=tok), duration_s=3.0,
                         rng=random.Random(1), rate=20.0)
    records = run.run(plan, 3.0)
    assert records and all(r.ok for r in records)
    assert 0 < max(peak) <= 3000
    assert run.scheduler.reserved_tokens("e0") == 0 and run.scheduler.stats()["queued_requests"] == 0
    later = [v for v in submitted if not v.rid.endswith("/0")]
    assert later and all(len(v.reply_tokens) == int(v.rid.rsplit("/", 1)[1]) for v in later)
    assert all(v.max_tokens is not None for v in submitted)


def test_gateway_output_hints_read_the_cap_and_reply_lengths_only_under_backlog():
    from types import SimpleNamespace

    from gateway.handlers import _output_hints

    body = {"max_tokens": 300, "messages": [
        {"role": "user", "content": "a b"},
        {"role": "assistant", "content": [{"type": "text", "text": "one two"}, {"type": "text", "text": "three"}]},
        {"role": "user", "content": "c"}]}

    def gw(policy):
        return SimpleNamespace(config=SimpleNamespace(scheduling=SimpleNamespace(policy=policy)),
                               tokenizer=SimpleNamespace(encode=str.split))

    assert _output_hints(gw("backlog"), body) == (300, (3,))
    assert _output_hints(gw("laps"), body) == (300, ())
    assert _output_hints(gw("backlog"), {"prompt": "x", "max_completion_tokens": 7}) == (7, ())


def test_sorted_f_replans_once_every_planned_request_is_gone():
    s = oracle("sorted_f", replan_every=10)
    s.submit(view("a", 10, 10), 0.0)
    s.submit(view("b", 10, 10), 0.0)
    assert dispatched(s.decide([engine(capacity=40)], 0.0)) == ["a", "b"] and s.plans_total == 1
    s.submit(view("c", 10, 10), 0.0)  # a backlog of 2 is no growth over the planned 2
    s.submit(view("d", 10, 10), 0.0)
    assert dispatched(s.decide([engine(capacity=80)], 0.0)) == ["c", "d"] and s.plans_total == 2


def test_sorted_f_makes_no_plan_for_a_backlog_of_one_request():
    # Light load: each request is alone in its backlog when the engine has room; there is nothing to order.
    s = oracle("sorted_f", replan_every=10)
    for i in range(5):
        s.submit(view(f"r{i}", 10, 10), float(i))
        assert dispatched(s.decide([engine(capacity=40)], float(i))) == [f"r{i}"]
        s.on_complete(f"r{i}", "e0", i + 0.5)
    assert s.plans_total == 0
    s.submit(view("x", 10, 10), 9.0)
    s.submit(view("y", 10, 10), 9.0)
    assert dispatched(s.decide([engine(capacity=40)], 9.0)) == ["x", "y"] and s.plans_total == 1
