"""Request priority: queue order within a class (scripted sequences), the header and field, what engines receive."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from multidict import CIMultiDict
from aiohttp.test_utils import TestServer

from gateway.app import create_app
from gateway.priority import PRIORITY_HEADER, low_values_first, queue_priority
from gateway.state import GATEWAY
from laps.config import load_config, parse_config
from policies.backlog_scheduler import BacklogConfig, BacklogScheduler
from policies.scheduler import ImmediateScheduler
from policies.types import EngineView, RequestView
from tests.fake_engine import FakeEngine

MODEL = "Qwen2.5-7B-Instruct"


def view(rid: str, priority: int | None, prompt_tokens: int = 10, request_class: str = "short") -> RequestView:
    return RequestView(rid, prompt_tokens, request_class=request_class, max_tokens=5, priority=priority)


def test_priority_rank_puts_higher_values_first_and_none_last():
    views = [view("none", None), view("low", -3), view("high", 9), view("zero", 0)]
    assert [v.rid for v in sorted(views, key=lambda v: v.priority_rank)] == ["high", "zero", "low", "none"]


def test_the_immediate_scheduler_dispatches_pending_requests_by_priority_then_arrival():
    scheduler = ImmediateScheduler()
    for rid, priority in (("a", None), ("b", 1), ("c", 5), ("d", 1)):
        scheduler.submit(view(rid, priority), 0.0)
    decision = scheduler.decide([EngineView("e0", "short")], 0.0)
    assert [d.rids for d in decision.dispatches] == [("c",), ("b",), ("d",), ("a",)]


@pytest.mark.parametrize("policy", ["fcfs", "mc_sf", "sorted_f"])
def test_the_backlog_admits_higher_priorities_first_one_at_a_time(policy):
    # A 2-token budget clips every reservation to 2: one request runs at a time, in admission order.
    scheduler = BacklogScheduler(BacklogConfig(policy=policy, default_memory_tokens=2))
    engines = [EngineView("e0", "short")]
    scheduler.submit(view("first", None), 0.0)
    assert [d.rids for d in scheduler.decide(engines, 0.0).dispatches] == [("first",)]
    for rid, priority in (("p1", 1), ("none", None), ("p7", 7), ("p1b", 1)):
        scheduler.submit(view(rid, priority), 0.0)
    order = []
    running = "first"
    for _ in range(4):
        assert scheduler.decide(engines, 0.0).dispatches == ()  # full until the running request completes
        scheduler.on_complete(running, "e0", 1.0)
        (dispatch,) = scheduler.decide(engines, 1.0).dispatches
        running = dispatch.rids[0]
        order.append(running)
    assert order == ["p7", "p1", "p1b", "none"]


def test_low_first_engines_reverse_the_queue_order():
    data = load_config().model_dump(exclude_unset=True)
    assert not low_values_first(parse_config(data))
    data["roles"]["short-prefill"]["flags"].update({"enable-priority-scheduling": True, "schedule-low-priority-values-first": True})
    assert low_values_first(parse_config(data))
    assert (queue_priority(3, True), queue_priority(queue_priority(3, True), True), queue_priority(3, False)) == (-3, 3, 3)


@pytest.fixture
async def gateway_with(request):
    """A gateway over fake engines sp0 (short pool) and lp0 (long pool); sp0's role schedules by priority.

    ``request.param``: extra top-level config keys (e.g. a scheduling policy).
    """
    data = load_config().model_dump(exclude_unset=True)
    data["roles"]["short-prefill"]["flags"]["enable-priority-scheduling"] = True
    data.update(getattr(request, "param", {}))
    fakes = {"sp0": FakeEngine("sp0"), "lp0": FakeEngine("lp0")}
    servers = {name: TestServer(f.app) for name, f in fakes.items()}
    for s in servers.values():
        await s.start_server()
    app = create_app(parse_config(data), engine_urls={n: str(s.make_url("")).rstrip("/") for n, s in servers.items()})
    gateway = TestServer(app)
    await gateway.start_server()
    async with aiohttp.ClientSession(str(gateway.make_url(""))) as session:
        yield session, fakes, app
    await gateway.close()
    for s in servers.values():
        await s.close()


def chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 5, **extra}


async def test_the_priority_goes_to_engines_that_schedule_by_it_and_not_to_others(gateway_with):
    session, fakes, _ = gateway_with
    async with session.post("/v1/chat/completions", json=chat("hi", priority=3)) as resp:
        assert resp.status == 200 and resp.headers["x-laps-engine"] == "sp0"
    async with session.post("/v1/chat/completions", json=chat("hi"), headers={PRIORITY_HEADER: "-4"}) as resp:
        assert resp.status == 200
    async with session.post("/v1/chat/completions", json=chat("hi", priority=3), headers={PRIORITY_HEADER: "8"}) as resp:
        assert resp.status == 200  # the header wins
    async with session.post("/v1/chat/completions", json=chat("hi")) as resp:
        assert resp.status == 200
    assert [b.get("priority") for b in fakes["sp0"].bodies] == [3, -4, 8, None]
    long_prompt = "Tell me everything about the history of pens. " * 60
    async with session.post("/v1/chat/completions", json=chat(long_prompt, priority=3)) as resp:
        assert resp.status == 200 and resp.headers["x-laps-engine"] == "lp0"
    assert "priority" not in fakes["lp0"].bodies[0]  # lp0's role has no enable-priority-scheduling


@pytest.mark.parametrize(("body", "headers", "param", "fragment"), [
    ({"priority": "high"}, {}, "priority", "Input should be a valid integer"),
    ({"priority": True}, {}, "priority", "Input should be a valid integer"),
    ({"priority": 1 << 63}, {}, "priority", "less than 9223372036854775808"),
    ({}, {PRIORITY_HEADER: "urgent"}, PRIORITY_HEADER, "expected a signed 64-bit integer, got 'urgent'"),
    ({}, {PRIORITY_HEADER: str(1 << 63)}, PRIORITY_HEADER, "expected a signed 64-bit integer"),
    ({}, {PRIORITY_HEADER: "1_000"}, PRIORITY_HEADER, "expected a signed 64-bit integer, got '1_000'"),
    ({}, {PRIORITY_HEADER: "+5"}, PRIORITY_HEADER, "expected a signed 64-bit integer, got '+5'"),
    ({}, {PRIORITY_HEADER: "\u0663"}, PRIORITY_HEADER, "expected a signed 64-bit integer, got '\u0663'"),
    ({}, [(PRIORITY_HEADER, "5"), (PRIORITY_HEADER, "x")], PRIORITY_HEADER, "header x-laps-priority was sent 2 times; send it once"),
])
async def test_a_bad_priority_is_a_400_naming_it(gateway_with, body, headers, param, fragment):
    session, fakes, _ = gateway_with
    async with session.post("/v1/chat/completions", json=chat("hi", **body), headers=CIMultiDict(headers)) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"] == param and fragment in error["message"] and fakes["sp0"].bodies == []


async def wait_for(condition, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("gateway_with", [{"scheduling": {"policy": "backlog",
                                                          "backlog": {"policy": "fcfs", "default_memory_tokens": 2}}}],
                         indirect=True)
async def test_the_gateway_queue_serves_higher_priorities_first(gateway_with):
    session, fakes, app = gateway_with
    dispatcher = app[GATEWAY].dispatcher
    sp0 = fakes["sp0"]
    sp0.hold_answers = True  # one request at a time (2-token budget); the first holds the engine

    async def send(content: str, priority: int | None):
        extra = {} if priority is None else {"priority": priority}
        async with session.post("/v1/chat/completions", json=chat(content, **extra)) as resp:
            assert resp.status == 200

    tasks = [asyncio.create_task(send("first", None))]
    await wait_for(lambda: len(sp0.bodies) == 1)
    for k, (content, priority) in enumerate((("low", 1), ("none", None), ("high", 9))):
        tasks.append(asyncio.create_task(send(content, priority)))
        await wait_for(lambda: dispatcher.queued == k + 1)  # queued in this order, behind the running request
    sp0.answer.set()
    await asyncio.gather(*tasks)
    assert [b["messages"][0]["content"] for b in sp0.bodies] == ["first", "high", "low", "none"]
