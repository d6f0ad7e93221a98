"""Frozen, broken and slow engines, and the gateway's shutdown: every request ends with its answer or an explicit error."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from gateway import health
from gateway.app import create_app, end_requests
from gateway.guard import RequestGuard
from gateway.errors import EngineTimeout
from gateway.health import SILENCE_SHARE_OF_STALL, HealthMonitor, check_waits, engine_failed, take_out_of_service
from gateway.state import GATEWAY
from gateway.supervisor import EngineSupervisor
from laps.config import load_config
from tests.fake_engine import FakeEngine
from tests.test_gateway import ADMIN, ADMIN_KEY, chat, with_gateway

FIRST_BYTE_S = 0.4
STALL_S = 0.6


@pytest.fixture
async def stack(request):
    """Fake engines sp0 (short pool) and lp0 (long pool) behind a gateway with short first-byte and stall timeouts
    (``gateway`` keys to override: the test's indirect parameter)."""
    fakes = {"sp0": FakeEngine("sp0"), "lp0": FakeEngine("lp0")}
    servers = {name: TestServer(f.app) for name, f in fakes.items()}
    for s in servers.values():
        await s.start_server()
    urls = {name: str(s.make_url("")).rstrip("/") for name, s in servers.items()}
    overrides = getattr(request, "param", {})
    config = with_gateway(load_config(), **{"admin_key": ADMIN_KEY, "first_byte_timeout_s": FIRST_BYTE_S, "stall_timeout_s": STALL_S, **overrides})
    app = create_app(config, engine_urls=urls)
    gateway = TestServer(app, handler_cancellation=True)
    await gateway.start_server()
    async with aiohttp.ClientSession(str(gateway.make_url(""))) as session:
        yield session, fakes, app
    for fake in fakes.values():
        fake.release.set()
        fake.answer.set()
    await gateway.close()
    for s in servers.values():
        await s.close()


def events(text: str) -> list[str]:
    return [e for e in text.split("\n\n") if e]


async def engine_states(session: aiohttp.ClientSession) -> dict[str, tuple[bool, bool]]:
    async with session.get("/health", headers=ADMIN) as resp:
        return {e["id"]: (e["healthy"], e["stalled"]) for e in (await resp.json())["engines"]}


async def test_a_stream_whose_engine_sends_no_first_byte_is_retried_on_another_engine(stack):
    session, fakes, _ = stack
    fakes["sp0"].hold_first = True  # frozen before its first byte
    async with session.post("/v1/chat/completions", json=chat("Hi", stream=True)) as resp:
        assert resp.status == 200 and resp.headers["x-laps-engine"] == "lp0"
        text = (await resp.read()).decode()
    assert "hi from lp0" in text and "hi from sp0" not in text and text.endswith("data: [DONE]\n\n")
    assert fakes["sp0"].bodies[0]["rid"] + "-retry" == fakes["lp0"].bodies[0]["rid"]
    await asyncio.wait_for(fakes["sp0"].abort_seen.wait(), timeout=5)  # the first try is aborted, not left running
    assert await engine_states(session) == {"sp0": (True, True), "lp0": (True, False)}  # sp0 stalled: no new work
    async with session.get("/health") as resp:
        assert (resp.status, (await resp.json())["status"]) == (200, "degraded")


async def test_a_started_stream_that_stalls_ends_with_an_error_event_and_done(stack):
    session, fakes, app = stack
    fakes["sp0"].hold_streams = True  # frozen after its first chunk
    async with session.post("/v1/chat/completions", json=chat("Hi", stream=True)) as resp:
        assert resp.status == 200
        got = events((await resp.read()).decode())
    assert "hi from sp0" in got[0] and got[-1] == "data: [DONE]"
    assert orjson.loads(got[-2].removeprefix("data: ")) == {"error": {
        "message": "engine sp0 stopped answering; retry later", "type": "engine_error", "param": None, "code": "engine_timeout"}}
    assert await engine_states(session) == {"sp0": (True, True), "lp0": (True, False)}
    await HealthMonitor(app[GATEWAY]).poll()  # its generation probe answers: back in service
    await asyncio.sleep(0.1)
    assert await engine_states(session) == {"sp0": (True, False), "lp0": (True, False)}
    async with session.get("/metrics") as resp:
        assert 'laps_requests_total{cls="short",outcome="engine_timeout"} 1.0' in await resp.text()


@pytest.mark.parametrize("stack", [{"first_byte_timeout_s": 60.0}], indirect=True)
async def test_the_stall_timeout_holds_even_when_the_first_byte_timeout_is_longer(stack):
    session, fakes, _ = stack
    fakes["sp0"].hold_streams = True
    async with session.post("/v1/chat/completions", json=chat("Hi", stream=True)) as resp:
        got = events((await asyncio.wait_for(resp.read(), timeout=20)).decode())  # cut after STALL_S, not 60 s
    assert got[-1] == "data: [DONE]" and orjson.loads(got[-2].removeprefix("data: "))["error"]["code"] == "engine_timeout"


async def test_a_slow_client_is_not_an_engine_stall(stack):
    session, fakes, _ = stack
    async with session.post("/v1/chat/completions", json=chat("Hi", stream=True)) as resp:
        await asyncio.sleep(2 * STALL_S)  # the client reads nothing for longer than the stall timeout
        text = (await resp.read()).decode()
    assert "error" not in text and text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("end", ["truncated", "malformed"])
async def test_a_broken_stream_ends_with_an_error_event_and_done_not_silence(stack, end):
    session, fakes, _ = stack
    fakes["sp0"].stream_end = end
    async with session.post("/v1/chat/completions", json=chat("Hi", stream=True)) as resp:
        got = events((await resp.read()).decode())
    if resp.headers["x-laps-engine"] == "lp0":  # the broken part came in sp0's first read: nothing was sent, so a retry
        assert "hi from lp0" in got[0] and got[-1] == "data: [DONE]" and "error" not in "".join(got)
        return
    assert "hi from sp0" in got[0] and got[-1] == "data: [DONE]" and len(got) == 3  # the broken part is not relayed
    error = orjson.loads(got[1].removeprefix("data: "))["error"]
    assert (error["code"], error["message"]) == ("engine_unavailable", "engine sp0 failed to answer; retry later")


async def test_a_malformed_json_answer_is_retried_elsewhere(stack):
    session, fakes, _ = stack
    fakes["sp0"].error_reply = (200, b"{not json")
    async with session.post("/v1/chat/completions", json=chat("Hi")) as resp:
        assert resp.status == 200 and resp.headers["x-laps-engine"] == "lp0"


@pytest.mark.parametrize("stack", [{"stall_timeout_s": 60.0}], indirect=True)  # only the shutdown ends the held stream
async def test_shutdown_ends_the_requests_left_after_the_grace_period_explicitly(stack, caplog):
    session, fakes, app = stack
    caplog.set_level(logging.INFO, logger="laps.gateway")
    gw = app[GATEWAY]
    fakes["sp0"].hold_streams = True
    fakes["lp0"].hold_answers = True
    stream = await session.post("/v1/chat/completions", json=chat("Hi", stream=True))
    assert b"hi from sp0" in await stream.content.readuntil(b"\n\n")
    plain = asyncio.ensure_future(session.post("/v1/chat/completions", json=chat(" word" * 300)))  # held on lp0
    await asyncio.wait_for(fakes["lp0"].received.wait(), timeout=5)
    closing = asyncio.ensure_future(end_requests(gw, grace_s=0.3))
    await asyncio.sleep(0.1)
    async with session.post("/v1/chat/completions", json=chat("Hi")) as resp:  # during the grace period: refused
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "shutting_down"
    async with session.get("/health") as resp:
        assert (resp.status, (await resp.json())["status"]) == (503, "shutting_down")
    await asyncio.wait_for(closing, timeout=10)
    got = events((await stream.read()).decode())
    assert got[-1] == "data: [DONE]" and orjson.loads(got[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    resp = await asyncio.wait_for(plain, timeout=5)
    assert resp.status == 503 and (await resp.json())["error"] == {
        "message": "the gateway is shutting down; retry on another instance or later", "type": "service_unavailable",
        "param": None, "code": "shutting_down"}
    assert not gw.guards
    cut = [(r.levelno, r.getMessage().split(": ", 1)[1]) for r in caplog.records if "mid-stream" in r.getMessage() or " cut: " in r.getMessage()]
    assert cut == [(logging.INFO, "stream to engine sp0 cut: the gateway is shutting down; the stream ends with an error event")]  # no engine failure


async def test_shutdown_waits_for_requests_that_finish_within_the_grace_period(stack):
    session, fakes, app = stack
    fakes["sp0"].hold_answers = True
    pending = asyncio.ensure_future(session.post("/v1/chat/completions", json=chat("Hi")))
    await asyncio.wait_for(fakes["sp0"].received.wait(), timeout=5)
    closing = asyncio.ensure_future(end_requests(app[GATEWAY], grace_s=30.0))
    await asyncio.sleep(0.2)
    fakes["sp0"].answer.set()
    resp = await asyncio.wait_for(pending, timeout=5)
    assert resp.status == 200 and (await resp.json())["choices"][0]["message"]["content"] == "hi from sp0"
    await asyncio.wait_for(closing, timeout=5)  # returns once nothing is in flight, long before the grace period ends


async def test_requests_waiting_on_an_engine_taken_out_of_service_are_retried_at_once(stack):
    session, fakes, app = stack
    gw = app[GATEWAY]
    fakes["sp0"].hold_answers = True  # a non-streamed answer: no byte limit, only the engine's health
    pending = asyncio.ensure_future(session.post("/v1/chat/completions", json=chat("Hi")))
    await asyncio.wait_for(fakes["sp0"].received.wait(), timeout=5)
    take_out_of_service(gw, gw.registry["sp0"], "GET /ready failed", stalled=False)  # as the health poll does
    resp = await asyncio.wait_for(pending, timeout=5)
    assert resp.status == 200 and resp.headers["x-laps-engine"] == "lp0"
    assert (await resp.json())["choices"][0]["message"]["content"] == "hi from lp0"
    await asyncio.wait_for(fakes["sp0"].abort_seen.wait(), timeout=5)  # the engine left behind drops its copy
    assert fakes["sp0"].aborted == [fakes["sp0"].bodies[0]["rid"]]


async def test_a_stuck_engine_holding_only_a_non_streamed_request_is_probed_taken_out_and_the_request_retried(stack):
    session, fakes, app = stack
    fakes["sp0"].hold_answers = True  # no stream to watch: the answer never comes
    fakes["sp0"].probe_status = 503  # and its scheduler cannot run a one-token generation either
    resp = await asyncio.wait_for(session.post("/v1/chat/completions", json=chat("Hi")), timeout=10)
    assert resp.status == 200 and resp.headers["x-laps-engine"] == "lp0"  # retried once sp0 failed its probe
    assert (await resp.json())["choices"][0]["message"]["content"] == "hi from lp0"
    assert fakes["sp0"].probed.is_set() and await engine_states(session) == {"sp0": (True, True), "lp0": (True, False)}
    await asyncio.wait_for(fakes["sp0"].abort_seen.wait(), timeout=5)


async def test_an_engine_that_answers_its_probe_keeps_its_slow_non_streamed_request(stack):
    session, fakes, app = stack
    fakes["sp0"].hold_answers = True  # a long generation, not streamed: quiet, but the engine runs
    pending = asyncio.ensure_future(session.post("/v1/chat/completions", json=chat("Hi")))
    await asyncio.wait_for(fakes["sp0"].probed.wait(), timeout=10)
    await asyncio.sleep(STALL_S)  # longer than the probe may take
    assert not pending.done() and await engine_states(session) == {"sp0": (True, False), "lp0": (True, False)}
    fakes["sp0"].answer.set()
    resp = await asyncio.wait_for(pending, timeout=5)
    assert resp.status == 200 and resp.headers["x-laps-engine"] == "sp0" and fakes["lp0"].bodies == []


async def test_quiet_waits_are_probed_once_the_engine_brought_nothing_past_the_silence_limit(stack):
    _, _, app = stack
    gw = app[GATEWAY]
    sp0, lp0 = gw.registry["sp0"], gw.registry["lp0"]
    limit_s = STALL_S * SILENCE_SHARE_OF_STALL
    started: list[tuple[str, str]] = []

    class Probes:
        answered_s: dict[str, float] = {}

        def start(self, engine, why):
            started.append((engine.id, why))

    # no await below: the gateway's own health monitor never sees these scripted waits
    waits = [RequestGuard(FIRST_BYTE_S, STALL_S) for _ in range(3)]
    for guard, engine, since_s, sent in zip(waits, (sp0, sp0, lp0), (100.0, 100.1, 50.0), (False, False, True)):
        guard.engine, guard.since_s, guard.sent = engine, since_s, sent  # lp0's client has bytes: check_silence's case
        gw.guards.add(guard)
    try:
        sp0.last_byte_s = lp0.last_byte_s = 99.0  # before the oldest wait began: quiet counts from 100.0
        check_waits(gw, Probes(), 100.0 + limit_s - 0.01)
        assert started == []
        check_waits(gw, Probes(), 100.0 + limit_s + 0.01)
        assert started == [("sp0", "its 2 waiting requests brought nothing for 0.2 s")]
        sp0.last_byte_s = 100.1  # an answer came since: quiet counts from it
        check_waits(gw, Probes(), 100.0 + limit_s + 0.05)
        assert len(started) == 1
        Probes.answered_s["sp0"] = 100.3  # and its probe answered later still: from that
        check_waits(gw, Probes(), 100.3 + limit_s - 0.01)
        assert len(started) == 1
        check_waits(gw, Probes(), 100.3 + limit_s + 0.01)
        assert started[1:] == [("sp0", "its 2 waiting requests brought nothing for 0.2 s")]
        sp0.stalled = True  # out of service already: the stalled engines' probe is the health monitor's
        check_waits(gw, Probes(), 1000.0)
        assert len(started) == 2
    finally:
        sp0.stalled = False
        gw.guards.difference_update(waits)


async def test_a_request_that_timed_out_on_an_engine_still_sending_bytes_has_the_engine_probed(stack):
    # New streams' first events keep sp0 from looking silent, yet a request on it timed out: not taken out on that
    # alone (a busy engine queues requests), but probed; once a probe has answered since, not again for it.
    _, _, app = stack
    gw = app[GATEWAY]
    sp0 = gw.registry["sp0"]
    now = asyncio.get_running_loop().time()
    started: list[tuple[str, str]] = []

    class Probes:
        answered_s: dict[str, float] = {}

        def start(self, engine, why):
            started.append((engine.id, why))

    sp0.last_byte_s = now  # bytes a moment ago
    engine_failed(gw, EngineTimeout(sp0, "no next chunk within 0.6 s"))
    assert sp0.serving and sp0.timed_out_s == pytest.approx(now, abs=0.5)
    check_waits(gw, Probes(), now)
    assert started == [("sp0", "a request on it timed out while it still sent bytes")]
    Probes.answered_s["sp0"] = sp0.timed_out_s + 0.01
    check_waits(gw, Probes(), now)
    assert len(started) == 1


@pytest.mark.parametrize("stack", [{"request_timeout_s": 0.5}], indirect=True)
async def test_an_answer_past_the_request_timeout_is_a_504_and_its_engine_is_left_to_its_probe(stack):
    # A slow non-streamed answer on sp0 passes gateway.request_timeout_s: the request ends with a 504 (its limit is
    # spent: no retry), and sp0, which answers its probe, stays in service (it was taken out as unreachable before,
    # and the request retried on lp0 for as long again).
    session, fakes, app = stack
    fakes["sp0"].hold_answers = True
    resp = await asyncio.wait_for(session.post("/v1/chat/completions", json=chat("Hi")), timeout=10)
    assert resp.status == 504 and (await resp.json())["error"] == {
        "message": "the answer of engine sp0 did not end within the gateway's request timeout; ask for fewer tokens or retry later",
        "type": "engine_error", "param": None, "code": "engine_timeout"}
    assert fakes["lp0"].bodies == []
    async with session.get("/metrics") as metrics:  # counted once, as what it was (not as a retry that never ran)
        assert 'laps_requests_total{cls="short",outcome="engine_timeout"} 1.0' in await metrics.text()
    await asyncio.wait_for(fakes["sp0"].abort_seen.wait(), timeout=5)  # the engine is told to drop it
    sp0 = app[GATEWAY].registry["sp0"]
    assert sp0.serving and sp0.timed_out_s > 0
    await asyncio.wait_for(fakes["sp0"].probed.wait(), timeout=5)  # the next health round probes it
    await asyncio.sleep(0.2)
    assert await engine_states(session) == {"sp0": (True, False), "lp0": (True, False)}


async def test_a_busy_engine_whose_probe_times_out_stays_in_service_until_it_keeps_failing(stack, monkeypatch):
    _, _, app = stack
    gw = app[GATEWAY]
    answers = {"sp0": "timeout", "lp0": "unreachable"}

    async def ready(url: str) -> str:
        return answers[next(e.id for e in gw.registry if e.url == url)]

    monkeypatch.setattr(gw.client, "ready", ready)
    monitor = HealthMonitor(gw)
    sp0, lp0 = gw.registry["sp0"], gw.registry["lp0"]
    sp0.last_byte_s = asyncio.get_running_loop().time()  # it answered a moment ago: busy, not dead
    await monitor.poll()
    assert (sp0.healthy, lp0.healthy) == (True, False)  # a refused connection is a dead engine at once
    await monitor.poll()
    assert sp0.healthy
    await monitor.poll()  # the third timeout in a row
    assert not sp0.healthy


async def test_an_engine_laps_runs_serves_only_while_its_own_process_runs_and_answers_on_its_port(stack, monkeypatch, caplog):
    """A crashed engine's port taken by another process (a stale engine of an earlier run) answers ``GET /ready``: the
    gateway would route to that process; an engine it runs counts as ready only while its process runs."""
    _, _, app = stack
    gw = app[GATEWAY]
    running = {"sp0": False, "lp0": True}  # as EngineProcess.alive() says: sp0 crashed, its restart pending
    monkeypatch.setattr(gw, "manager", SimpleNamespace(engines={
        name: SimpleNamespace(alive=lambda name=name: running[name], port=i, process=SimpleNamespace(pid=100 + i))
        for i, name in enumerate(running)}))
    listeners = {0: {999}, 1: {101}}  # port -> process groups listening: sp0's port (0) held by a stranger
    monkeypatch.setattr(health, "port_listeners", listeners.get)
    caplog.set_level(logging.WARNING, logger="laps.gateway")
    monitor = HealthMonitor(gw)
    await monitor.poll()  # both fake engines answer /ready
    assert (gw.registry["sp0"].healthy, gw.registry["lp0"].healthy) == (False, True)
    assert "engine sp0 is out of service: its process is not running" in caplog.text
    running["sp0"] = True  # restarted, still loading: the stranger answers /ready
    await monitor.poll()
    assert not gw.registry["sp0"].healthy
    listeners[0] = {100}  # its own process listens now
    await monitor.poll()
    assert gw.registry["sp0"].healthy


async def test_an_engine_back_in_service_is_logged_at_info(stack, monkeypatch, caplog):
    _, _, app = stack
    gw = app[GATEWAY]

    async def ready(url: str) -> str:
        return "ready"

    monkeypatch.setattr(gw.client, "ready", ready)
    gw.registry["lp0"].healthy = False
    caplog.set_level(logging.INFO, logger="laps.gateway")
    await HealthMonitor(gw).poll()
    assert gw.registry["lp0"].healthy
    assert [(r.levelno, r.getMessage()) for r in caplog.records if "now healthy" in r.getMessage()] == [(logging.INFO, "engine lp0 is now healthy")]


async def test_an_engine_whose_restart_started_no_process_is_restarted_again_after_the_backoff():
    """A restart that failed before its process started (the engine stopped, then its start raised) left the engine with
    no process, which the supervisor took for an engine nobody runs: never restarted again."""
    now = [0.0]
    engine = SimpleNamespace(process=SimpleNamespace(returncode=-9), alive=lambda: False, restarting=False, role="long-prefill",
                             log_path="engine-lp0.log")
    tries = []

    async def restart(name, role, client):
        tries.append((now[0], name, role))
        engine.process = None  # stopped, and the start raised before a process ran
        raise OSError("no such file: python")

    gw = SimpleNamespace(manager=SimpleNamespace(engines={"lp0": engine}, restart=restart), client=None,
                         prefix_index=SimpleNamespace(forget_engine=lambda name: None))
    supervisor = EngineSupervisor(gw, clock=lambda: now[0])
    for t in (0.0, 0.5, 1.5, 2.5, 3.5):
        now[0] = t
        supervisor.check()
        await asyncio.sleep(0)  # the restart task runs (and fails)
    assert tries == [(0.0, "lp0", "long-prefill"), (1.5, "lp0", "long-prefill"), (3.5, "lp0", "long-prefill")]  # after 1 s, then 2 s
    await supervisor.close()
