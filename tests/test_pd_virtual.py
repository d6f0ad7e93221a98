"""Prefill–decode disaggregation: the engine model's PD modes and the virtual-time PD deployment."""

from __future__ import annotations

import random

import pytest

from engines.sim.core import NUM_RESERVED_DECODE_TOKENS, EngineConfig, EngineCore
from engines.sim.kv_transfer import LINKS
from engines.sim.latency import MODELS, make_latency_model
from engines.sim.replies import ReplyPlanner
from laps.config import parse_config
from laps.tokenizer import load_tokenizer
from loadgen.runner import Arrival, plan_arrivals
from loadgen.simulate import simulate
from loadgen.virtual import VirtualRun
from loadgen.virtual_pd import VirtualPDRun
from loadgen.workloads import Conversation, Turn, build_workload

TOK = load_tokenizer()
LATENCY = make_latency_model()
PLANNER = ReplyPlanner(TOK)


def make_core(mode: str, **overrides) -> EngineCore:
    cfg = {"max_total_tokens": 100_000, "max_running_requests": 64, "disaggregation_mode": mode, **overrides}
    return EngineCore(EngineConfig(**cfg), LATENCY, TOK)


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


# ---- the engine model ------------------------------------------------------------------------


def test_a_prefill_engine_hands_off_the_first_token_and_holds_the_kv_until_the_transfer():
    core = make_core("prefill")
    core.add_request("r", prompt(300), 50, ignore_eos=True)
    step = core.step(0.0)
    (ev,) = step.events
    first = PLANNER.plan("r", 50, True).token_ids[0]
    assert (ev.kv_ready, ev.first_token, ev.new_token_ids, ev.finish_reason) == (True, True, (first,), None)
    assert step.prefill == ((300, 0),) and step.num_decode_seqs == 0
    assert not core.has_work() and core.step(step.duration_s).idle  # nothing decodes on a prefill engine
    assert core.stats().num_used_tokens == 300  # pinned for the transfer
    done = core.finish_transfer("r")
    assert done is not None and (done.finish_reason, done.completion_tokens) == ("length", 1)
    assert core.finish_transfer("r") is None
    assert (core.stats().num_used_tokens, core.stats().evictable_tokens) == (0, 300)  # kept as prefix cache
    core.add_request("again", prompt(300) + prompt(20, 5000), 5, ignore_eos=True)
    (again,) = core.step(1.0).events
    assert again.cached_tokens == 300


def test_a_prefill_engine_reserves_one_new_token_per_request():
    # 1000-token pool: a 400-token prompt asking 500 tokens fits only because admission counts max_new 1 (SGLang).
    core = make_core("prefill", max_total_tokens=1000)
    core.add_request("a", prompt(400), 500, ignore_eos=True)
    core.add_request("b", prompt(400, 5000), 500, ignore_eos=True)
    assert [ev.rid for ev in core.step(0.0).events] == ["a", "b"]


def test_a_decode_engine_takes_requests_only_with_their_kv():
    core = make_core("decode")
    with pytest.raises(ValueError, match="disaggregation-mode decode"):
        core.add_request("r", prompt(10), 5)
    with pytest.raises(ValueError, match="needs --disaggregation-mode decode"):
        make_core("null").add_transferred_request("r", prompt(10), 5)
    with pytest.raises(ValueError, match="--disaggregation-mode bogus"):
        make_core("bogus")


def test_a_decode_engine_streams_the_first_token_on_admission_then_decodes():
    core = make_core("decode")
    core.add_transferred_request("r", prompt(300), 3, ignore_eos=True, now=2.0)
    assert core.has_work()
    step = core.step(2.5)
    plan = PLANNER.plan("r", 3, True).token_ids
    (first,) = step.admitted
    assert (first.first_token, first.new_token_ids, first.queue_time_s) == (True, plan[:1], 0.5)
    assert step.prefill == () and (step.num_decode_seqs, step.decode_context_tokens) == (1, 300)  # no prefill compute
    assert [ev.new_token_ids for ev in step.events] == [plan[1:2]]
    last = core.step(2.5 + step.duration_s)
    assert (last.events[0].new_token_ids, last.events[0].finish_reason) == (plan[2:3], "length")


def test_decode_admission_keeps_room_for_the_running_requests():
    # Pool 2000: a 300-token request runs; the next needs 700 + 512·2 = 1724 > room (2000 − 301 − 1) and waits.
    pool = 2000
    core = make_core("decode", max_total_tokens=pool)
    core.add_transferred_request("a", prompt(300), 3, ignore_eos=True)
    assert len(core.step(0.0).admitted) == 1
    core.add_transferred_request("b", prompt(700, 5000), 3, ignore_eos=True, now=0.01)
    assert 700 + NUM_RESERVED_DECODE_TOKENS * 2 > pool - 302
    step = core.step(0.01)
    assert step.admitted == () and step.num_decode_seqs == 1 and core.stats().num_waiting_reqs == 1
    now = 0.01 + step.duration_s
    while core.stats().num_running_reqs:  # a finishes, then b gets in
        step = core.step(now)
        now += step.duration_s
    assert [ev.rid for ev in core.step(now).admitted] == ["b"]


def test_abort_reaches_transferring_and_arrived_requests():
    prefill = make_core("prefill")
    prefill.add_request("r", prompt(100), 5)
    prefill.step(0.0)
    assert prefill.abort("r").finish_reason == "abort"
    assert prefill.stats().num_used_tokens == 0 and prefill.finish_transfer("r") is None
    decode = make_core("decode")
    decode.add_transferred_request("r", prompt(100), 5)
    assert decode.abort("r").finish_reason == "abort"
    assert not decode.has_work() and decode.step(0.0).idle


# ---- the virtual-time deployment -------------------------------------------------------------

ROLES = {
    "short-prefill": {"pool": "short", "flags": {"chunked-prefill-size": 2048}},
    "long-prefill": {"pool": "long", "flags": {"chunked-prefill-size": 16384}},
    "decode": {"pool": "decode", "flags": {}},
}


def pd_config(roles: list[str], policy: str = "laps", link: str = "infiniband", **extra):
    return parse_config({
        "scheduling": {"policy": policy},
        "pd": {"link": link},
        "roles": ROLES,
        "engines": [{"name": f"e{i}", "kind": "sim", "role": r, "gpus": [i]} for i, r in enumerate(roles)],
        **extra,
    })


def one_request_plan(user_text: str, max_tokens: int) -> list[Arrival]:
    return [Arrival(0.0, Conversation("c", "test", (Turn(user_text, max_tokens),)), ())]


def test_ttft_is_prefill_plus_transfer_on_an_idle_deployment():
    run = VirtualPDRun(pd_config(["short-prefill", "decode"]), TOK)
    (rec,) = run.run(one_request_plan("Tell me about the moon.", 8), 1.0)
    prompt_ids = TOK.encode_chat([{"role": "user", "content": "Tell me about the moon."}])
    # The same prefill on a lone engine of the prefill engine's configuration gives the pass time.
    twin = EngineCore(run.engines["e0"].core.config, run.engines["e0"].core.latency, TOK)
    twin.add_request("x", prompt_ids, 8)
    prefill_s = twin.step(0.0).duration_s
    transfer_s = len(prompt_ids) * MODELS["qwen2.5-7b"].kv_bytes_per_token / LINKS["infiniband"].bandwidth_bytes_per_s
    (t,) = run.transfers
    # The idle prefill engine takes the lone short request at once (no AWD window while an engine is idle), then
    # the transfer; the idle decode engine admits it the moment the KV lands and streams the first token.
    assert t.start_s == pytest.approx(prefill_s, abs=1e-12)
    assert t.end_s - t.start_s == pytest.approx(transfer_s, abs=1e-12)
    assert rec.ttft_s == pytest.approx(t.end_s, abs=1e-12)
    assert rec.ok and rec.completion_tokens == 8 and rec.cached_tokens == 0


def test_round_robin_ttft_is_exactly_prefill_plus_transfer():
    run = VirtualPDRun(pd_config(["short-prefill", "decode"], policy="round_robin", link="tcp"), TOK)
    (rec,) = run.run(one_request_plan("Tell me about the moon.", 8), 1.0)
    prompt_ids = TOK.encode_chat([{"role": "user", "content": "Tell me about the moon."}])
    twin = EngineCore(run.engines["e0"].core.config, run.engines["e0"].core.latency, TOK)
    twin.add_request("x", prompt_ids, 8)
    expected = twin.step(0.0).duration_s + len(prompt_ids) * 57_344 / 12.5e9
    assert rec.ttft_s == pytest.approx(expected, abs=1e-12)


def test_a_tensor_parallel_prefill_engine_sends_each_ranks_share_over_its_own_link_and_the_summary_counts_it():
    # TP 2: each rank holds half the KV heads and sends them over its own link, as the live simulated engine prices it.
    config = parse_config({"scheduling": {"policy": "round_robin"}, "pd": {"link": "tcp"}, "roles": ROLES, "engines": [
        {"name": "e0", "kind": "sim", "role": "short-prefill", "gpus": [0, 1]},
        {"name": "e1", "kind": "sim", "role": "decode", "gpus": [2]}]})
    run = VirtualPDRun(config, TOK)
    (rec,) = run.run(one_request_plan("Tell me about the moon.", 8), 1.0)
    n = len(TOK.encode_chat([{"role": "user", "content": "Tell me about the moon."}]))
    (t,) = run.transfers
    assert t.nbytes == n * 57_344 / 2 and t.end_s - t.start_s == pytest.approx(n * 57_344 / 2 / 12.5e9, abs=1e-12)
    summary = run.summary()["kv_transfer"]
    assert (set(run.summary()), summary["count"], summary["bytes"]) == ({"scheduler", "kv_transfer"}, 1, t.nbytes)
    assert summary["time_s"] == pytest.approx({q: t.end_s - t.start_s for q in ("mean", "p50", "p90", "p99")}, abs=1e-15)
    assert summary["inflation"] == pytest.approx({q: 1.0 for q in ("mean", "p50", "p90", "p99")}, abs=1e-9)
    assert rec.ok


def mixed_plan(rate: float, duration_s: float, seed: int = 0) -> list[Arrival]:
    workload = build_workload("mixed", random.Random(f"workload/{seed}"), tokenizer=TOK)
    return plan_arrivals(workload, duration_s=duration_s, rng=random.Random(f"arrivals/{seed}"), rate=rate)


def first_token_times(records) -> dict[str, float]:
    return {f"{r.conversation_id}/{r.turn}": r.start_s + r.ttft_s for r in records if r.ttft_s is not None}


@pytest.mark.parametrize(("policy", "timeout_s"), [("laps", 0.5), ("cache_aware", 0.5), ("cache_aware", 0.03)])
def test_every_request_is_answered_and_no_first_token_precedes_its_kv(policy, timeout_s):
    # A 30 ms timeout withdraws requests while they prefill, while their KV is on the (TCP) link, and while they decode.
    roles = ["short-prefill", "long-prefill", "decode", "decode"] if policy == "laps" else ["short-prefill"] * 2 + ["decode"] * 2
    plan = mixed_plan(rate=30.0, duration_s=4.0)
    run = VirtualPDRun(pd_config(roles, policy=policy, link="tcp"), TOK, request_timeout_s=timeout_s)
    records = run.run(plan, 4.0)
    assert len(records) > 100
    assert all(r.end_s is not None and (r.ok or r.error) for r in records)
    assert any(r.ok for r in records) and (timeout_s > 0.1 or sum(not r.ok for r in records) > 50)
    first = first_token_times(records)
    assert run.transfers and all(first[t.tid] >= t.end_s - 1e-12 for t in run.transfers if t.tid in first)
    # Everything was let go: nothing in flight at the gateway, on the link, or holding KV on an engine.
    assert all(e.in_flight == 0 for e in run.registry) and run.network.in_flight == 0
    assert all(not e.core.has_work() and e.core.stats().num_used_tokens == 0 for e in run.engines.values())


def test_on_pass_sees_every_pass_in_order_and_each_first_token_leaves_as_a_decode_pass_starts():
    passes: dict[str, list[tuple[float, float]]] = {}
    run = VirtualPDRun(pd_config(["short-prefill", "long-prefill", "decode", "decode"]), TOK)
    records = run.run(mixed_plan(rate=30.0, duration_s=2.0), 2.0,
                      on_pass=lambda engine, start_s, result: passes.setdefault(engine, []).append((start_s, result.duration_s)))
    assert set(passes) == {"e0", "e1", "e2", "e3"}
    for engine, ps in passes.items():  # one pass at a time on each engine, in time order
        assert all(s + d <= nxt + 1e-12 for (s, d), (nxt, _) in zip(ps, ps[1:]))
    for engine in ("e0", "e1"):  # a prefill engine's passes are all prefill
        assert sum(d for _, d in passes[engine]) == pytest.approx(run.engines[engine].core.stats().total_prefill_busy_s)
    decode_starts = {s for engine in ("e2", "e3") for s, _ in passes[engine]}
    first = first_token_times(records)
    assert len(first) > 50 and all(t in decode_starts for t in first.values())


def test_only_prefill_engines_reach_the_scheduler_and_the_decode_placement_gets_decode_engines():
    run = VirtualPDRun(pd_config(["short-prefill", "long-prefill", "decode", "decode"]), TOK)
    assert [v.id for v in run.registry.views()] == ["e0", "e1"]
    assert [v.id for v in run.registry.decode_views()] == ["e2", "e3"]
    records = run.run(mixed_plan(rate=10.0, duration_s=2.0), 2.0)
    assert {t.src for t in run.transfers} <= {"e0", "e1"} and {t.dst for t in run.transfers} == {"e2", "e3"}
    assert len(run.transfers) == sum(r.ok for r in records)


def test_the_controller_moves_prefill_engines_only():
    # Long-heavy load on 2 short + 1 long prefill engines: the long pool's pressure pulls short engines over.
    controller = {"enabled": True, "interval_s": 0.5, "cooldown_s": 0.0, "hysteresis": 0.1, "sim_restart_s": 0.5,
                  "drain_timeout_s": 5.0}
    roles = ["short-prefill", "short-prefill", "long-prefill", "decode", "decode"]
    run = VirtualPDRun(pd_config(roles, controller=controller), TOK)
    run.run(mixed_plan(rate=60.0, duration_s=8.0), 8.0)
    assert run.moves, "the scenario must make the controller move something"
    assert {m["engine"] for m in run.moves} <= {"e0", "e1", "e2"}
    assert {(m["from_pool"], m["to_pool"]) for m in run.moves} <= {("short", "long"), ("long", "short")}
    assert [run.registry[e].pool for e in ("e3", "e4")] == ["decode", "decode"]


def test_a_pd_run_needs_the_pd_section():
    config = parse_config({"roles": {"s": {"pool": "short"}}, "engines": [{"name": "e0", "role": "s"}]})
    with pytest.raises(ValueError, match="needs a prefill-decode deployment"):
        VirtualPDRun(config, TOK)
    assert isinstance(VirtualRun(config, TOK), VirtualRun)


def test_simulate_runs_a_pd_deployment_as_a_pd_run():
    config = pd_config(["short-prefill", "long-prefill", "decode"])
    workload = build_workload("mixed", random.Random("workload/0"), tokenizer=TOK)
    records = simulate(config, workload, duration_s=1.0, seed=0, rate=5.0, tokenizer=TOK)
    assert records and all(r.ok for r in records)
