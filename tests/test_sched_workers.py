"""Several gateway processes: the LAPS decisions through the real channel equal one process's on a scripted sequence;
the scheduler releases a dead worker's requests; in PD it picks the decode engine and keeps both sides' load."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from functools import partial
from types import SimpleNamespace

import pytest
import yaml

from gateway.dispatcher import Arrival, Dispatcher, classify
from gateway.errors import APIError, EngineUnavailable
from gateway.health import SILENCE_SHARE_OF_STALL, back_in_service, check_silence, engine_failed
from gateway.registry import EngineRegistry, EngineState
from gateway.sched_channel import ChannelClient, ChannelClosed
from gateway.sched_service import SchedulerService
from gateway.priority import engine_role
from gateway.pd_setup import PDDispatch
from gateway.sched_worker import (STATE_POLL_S, RemoteDecodeSide, RemoteDispatcher, RemotePrefixIndex, StatePoller, admin_caller,
                                  registry_of, report_out_of_service)
from laps.config import DEFAULT_CONFIG_PATH, parse_config
from laps.cost import engine_traits
from policies.exact_prefix import PrefixCaches
from policies.pool_signals import FirstTokenWindow
from policies.prefix_index import BlockChain, PrefixIndex
from policies.registry import make_classifier, make_decode_placement, make_scheduler
from tests.pd_stack import pd_config

ENGINES = [("sp0", "short-prefill"), ("sp1", "short-prefill"), ("lp0", "long-prefill")]


def _config():
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    data["engines"] = [{"name": name, "kind": "sim", "role": role, "gpus": [i]} for i, (name, role) in enumerate(ENGINES)]
    data["slo"] = {"ttft_s": 0.4, "ttft_per_1k_new_tokens_s": 0.05}  # length-aware deadlines: decided where the index is
    data["controller"] = {"enabled": False}
    data.setdefault("scheduling", {}).setdefault("laps", {})["awd_windows"] = True  # held requests: timers cross the channel too
    return parse_config(data, "test")


class Clock:
    """The scripted time (seconds); both runs see the same instants."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _scheduler_side(config, clock):
    """A scheduler process's dispatcher, prefix caches and registry (what SchedulerService uses of a Gateway)."""
    registry = EngineRegistry([EngineState(name, f"http://{name}", config.roles[role].pool) for name, role in ENGINES])
    prefix_index = PrefixCaches(PrefixIndex(config.scheduling.prefix_block_tokens, 4096))
    dispatcher = Dispatcher(make_scheduler(config.scheduling, engine_traits(config)), registry, clock=clock,
                            classify=partial(classify, config=config, registry=registry, prefix_index=prefix_index,
                                             classifier=make_classifier(config.scheduling)),
                            prefills=prefix_index.in_flight)
    return SimpleNamespace(config=config, dispatcher=dispatcher, prefix_index=prefix_index, registry=registry, context_tokens=None,
                           client=None, manager=None, engine_roles=None, pd=None)


def _script(seed: int = 7, steps: int = 120):
    """Arrivals (conversations sharing prefixes, short and long prompts, some with their own deadline), first tokens,
    completions and time steps, in a seeded order."""
    rng = random.Random(seed)
    histories = [[rng.randrange(1000) for _ in range(rng.choice((40, 300, 1500)))] for _ in range(6)]
    events = []
    for i in range(steps):
        kind = rng.choices(("arrive", "first", "complete", "advance"), weights=(4, 2, 2, 3))[0]
        if kind == "arrive":
            conversation = histories[rng.randrange(len(histories))]
            conversation.extend(rng.randrange(1000) for _ in range(rng.choice((8, 64, 600))))
            deadline = rng.choice((None, None, 2.0))
            events.append(("arrive", f"r{i}", list(conversation), deadline))
        elif kind == "advance":
            events.append(("advance", rng.choice((0.001, 0.004, 0.02, 0.2))))
        else:
            events.append((kind,))
    return events


async def _run(config, front_of) -> list:
    """Play :func:`_script` through a front dispatcher and prefix index (``front_of(side)`` -> (dispatcher, index,
    sync)); the decision of each request: (rid, engine or error, class, cached tokens per engine, deadline)."""
    clock = Clock()
    side = _scheduler_side(config, clock)
    front, index, sync = await front_of(side)
    tasks: dict[str, asyncio.Task] = {}
    chains: dict[str, BlockChain] = {}
    started, running = [], []  # placed, first token not yet / placed, first token seen
    decisions = {}

    async def settle():
        await sync()
        while any(not t.done() for rid, t in tasks.items() if rid not in {v.rid for v in side.dispatcher.queued_requests()}):
            await asyncio.sleep(0.001)  # a decision on its way back (or a place call on its way in)
        for rid, task in tasks.items():
            if task.done() and rid not in decisions:
                try:
                    view, engine = task.result()
                except APIError as err:
                    decisions[rid] = (rid, f"error {err.status}")
                    continue
                decisions[rid] = (rid, engine, view.request_class, dict(view.cached_by_engine), round(view.deadline_s - clock.now, 9))
                started.append((view, engine))

    for event in _script():
        if event[0] == "arrive":
            _, rid, tokens, deadline = event
            chains[rid] = BlockChain(config.scheduling.prefix_block_tokens).extend(tokens)
            arrival = Arrival(rid, chains[rid], clock.now, None if deadline is None else clock.now + deadline, max_tokens=64)
            tasks[rid] = asyncio.ensure_future(front.place(arrival))
        elif event[0] == "first" and started:
            view, engine = started.pop(0)
            index.insert(engine, chains[view.rid].keys)
            front.first_token(view.rid, engine, None)
            running.append((view, engine))
        elif event[0] == "complete" and running:
            view, engine = running.pop(0)
            index.observe(engine, chains[view.rid].keys, None)
            front.complete(view, engine)
        elif event[0] == "advance":
            await sync()  # what was sent before the step is applied first
            clock.now += event[1]
            side.dispatcher._decide()  # the scheduler's timer, at the scripted instant
        await settle()
    side.dispatcher.fail_waiting(lambda: APIError(503, "end of script"))
    await settle()
    side.dispatcher.close()
    return [decisions[rid] for rid in tasks]


async def _in_one_process(side):
    async def sync():
        await asyncio.sleep(0)

    return side.dispatcher, side.prefix_index, sync


def _through_the_channel(path):
    async def front_of(side):
        service = SchedulerService(side, {})
        await service.start(str(path))
        channel = await ChannelClient.connect(path)

        async def sync():  # the scheduler answers in order: every frame sent before this call has been applied
            await channel.call({"op": "state"})

        return RemoteDispatcher(channel), RemotePrefixIndex(channel, side.prefix_index.block_tokens), sync

    return front_of


async def test_laps_decisions_are_the_same_with_one_process_and_through_the_channel(tmp_path):
    config = _config()
    assert config.scheduling.policy == "laps"
    alone = await _run(config, _in_one_process)
    remote = await _run(config, _through_the_channel(tmp_path / "sched.sock"))
    assert remote == alone
    placed = [d for d in alone if not d[1].startswith("error")]
    # the script exercises what the decision depends on: every engine, both classes, prefix hits, held requests
    assert {d[1] for d in placed} == {"sp0", "sp1", "lp0"}
    assert {d[2] for d in placed} == {"short", "long"}
    assert any(max(d[3].values()) > 0 for d in placed)
    assert len(placed) > 20


async def test_a_dead_workers_requests_are_released_and_aborted(tmp_path):
    config = _config()
    side = _scheduler_side(config, Clock())
    aborted = []

    async def abort(url, rid):
        aborted.append((url, rid))

    side.client = SimpleNamespace(abort=abort)
    service = SchedulerService(side, {})
    await service.start(str(tmp_path / "sched.sock"))
    dead, alive = await ChannelClient.connect(tmp_path / "sched.sock"), await ChannelClient.connect(tmp_path / "sched.sock")
    try:
        chain = BlockChain(config.scheduling.prefix_block_tokens).extend(range(2000))  # long: no AWD window

        def in_flight():
            return {e.id: e.in_flight for e in side.registry if e.in_flight}

        _, dead_engine = await RemoteDispatcher(dead).place(Arrival("dead-1", chain, 1000.0, None))
        other, engine = await RemoteDispatcher(alive).place(Arrival("alive-1", chain, 1000.0, None))
        assert sum(in_flight().values()) == 2
        await dead.close()  # as the kernel closes a killed worker's socket
        while not aborted:
            await asyncio.sleep(0.01)
        assert aborted == [(f"http://{dead_engine}", "dead-1")]
        assert in_flight() == {engine: 1}  # the live worker's request goes on
        RemoteDispatcher(alive).complete(other, engine)
        await alive.call({"op": "state"})
        assert in_flight() == {}
    finally:
        await alive.close()
        await service.close()
        side.dispatcher.close()


async def test_a_held_request_is_withdrawn_when_its_caller_goes_and_when_its_worker_goes(tmp_path):
    config = _config()
    side = _scheduler_side(config, Clock())
    aborted = []

    async def abort(url, rid):
        aborted.append(rid)

    side.client = SimpleNamespace(abort=abort)
    service = SchedulerService(side, {})
    await service.start(str(tmp_path / "sched.sock"))
    first, second = await ChannelClient.connect(tmp_path / "sched.sock"), await ChannelClient.connect(tmp_path / "sched.sock")
    try:
        short = BlockChain(config.scheduling.prefix_block_tokens).extend(range(40))
        for rid in ("busy-1", "busy-2", "busy-3"):  # every engine prefilling: the next short request is held in an AWD window
            await RemoteDispatcher(first).place(Arrival(rid, short, 1000.0, None))
        call = asyncio.ensure_future(RemoteDispatcher(first).place(Arrival("gone-1", short, 1000.0, None)))
        await asyncio.sleep(0)  # its place call goes first
        await first.call({"op": "state"})
        assert [v.rid for v in side.dispatcher.queued_requests()] == ["gone-1"]
        call.cancel()  # the client went away: the worker tells the scheduler
        await first.call({"op": "state"})
        assert side.dispatcher.queued == 0
        held = asyncio.ensure_future(RemoteDispatcher(second).place(Arrival("dead-1", short, 1000.0, None)))
        await asyncio.sleep(0)
        await second.call({"op": "state"})
        assert side.dispatcher.queued == 1
        await second.close()  # its worker died
        while side.dispatcher.queued:
            await asyncio.sleep(0.01)
        assert held.done() and aborted == []  # withdrawn before any engine got it
        assert sum(e.in_flight for e in side.registry) == 3  # the busy ones only
    finally:
        await first.close()
        await service.close()
        side.dispatcher.close()


async def test_a_request_whose_caller_went_away_in_the_same_turn_is_not_dispatched_to_it():
    side = _scheduler_side(_config(), Clock())
    dispatcher = side.dispatcher
    short = BlockChain(16).extend(range(40))
    busy = [await dispatcher.place(Arrival(f"busy-{i}", short, 1000.0, None)) for i in range(3)]  # every engine prefilling
    held = asyncio.ensure_future(dispatcher.place(Arrival("held", short, 1000.0, None)))
    await asyncio.sleep(0)
    assert dispatcher.queued == 1
    held.cancel()  # its client went away; in the same turn another request's first token frees an engine
    view, engine = busy[0]
    dispatcher.first_token(view.rid, engine, None)
    dispatcher.complete(view, engine)
    await asyncio.sleep(0)
    assert held.cancelled() and dispatcher.queued == 0
    assert sum(e.in_flight for e in side.registry) == 2  # the other busy ones: "held" counts nowhere
    dispatcher.close()


async def test_an_admin_call_to_a_lost_scheduler_answers_503_scheduler_unavailable():
    class Lost:
        async def call(self, message: dict) -> dict:
            raise ChannelClosed("the scheduler closed the channel")

    answer = await admin_caller(Lost())({"op": "admin_engines"})
    assert answer == {"error": {"status": 503, "message": "the gateway's scheduler is not reachable; retry later",
                                "type": "service_unavailable", "param": None, "code": "scheduler_unavailable"}}


@contextlib.asynccontextmanager
async def served(side, tmp_path) -> AsyncIterator[ChannelClient]:
    """``side`` served by a :class:`SchedulerService` on a socket under ``tmp_path``, and a channel to it; both closed
    after."""
    service = SchedulerService(side, {})
    await service.start(str(tmp_path / "sched.sock"))
    channel = await ChannelClient.connect(tmp_path / "sched.sock")
    try:
        yield channel
    finally:
        await channel.close()
        await service.close()


async def test_the_state_call_carries_each_engines_role_now_and_a_worker_mirrors_it(tmp_path):
    config = _config()
    side = _scheduler_side(config, Clock())
    async with served(side, tmp_path) as channel:
        state = await channel.call({"op": "state"})
        assert state["roles"] == {"sp0": "short-prefill", "sp1": "short-prefill", "lp0": "long-prefill"}
        poller = StatePoller(channel, registry_of(state["engines"]), state)
        side.engine_roles = {"sp0": "short-prefill", "sp1": "mixed", "lp0": "long-prefill"}  # as if sp1 had been moved
        await asyncio.sleep(STATE_POLL_S * 2.5)
        assert poller.roles["sp1"] == "mixed"
        worker = SimpleNamespace(config=config, manager=None, engine_roles=poller.roles)
        assert engine_role(worker, "sp1") == "mixed" and engine_role(worker, "sp0") == "short-prefill"
        await poller.close()


async def test_a_worker_hears_which_engines_the_scheduler_took_out_of_service_and_ends_its_waits_on_them(tmp_path):
    # Another worker (or the scheduler's health poll) took sp1 out, stalled, and lp0 out, unhealthy; sp0 is draining
    # (its requests finish there). This worker's requests waiting on sp1 and lp0 must end now (retried elsewhere),
    # not when their own timeouts or request_timeout_s come.
    side = _scheduler_side(_config(), Clock())
    left: list[str] = []
    async with served(side, tmp_path) as channel:
        state = await channel.call({"op": "state"})
        poller = StatePoller(channel, registry_of(state["engines"]), state, left_service=lambda engine: left.append(engine.id))
        side.registry["sp1"].stalled = True
        side.registry["lp0"].healthy = False
        side.registry["sp0"].draining = True
        await asyncio.sleep(STATE_POLL_S * 2.5)
        assert left == ["sp1", "lp0"]  # once each, however many polls say so
        side.registry["sp1"].stalled = False
        await asyncio.sleep(STATE_POLL_S * 2.5)
        side.registry["sp1"].stalled = True  # out again: heard again
        await asyncio.sleep(STATE_POLL_S * 2.5)
        assert left == ["sp1", "lp0", "sp1"]
        await poller.close()
    side.dispatcher.close()


async def test_a_workers_silent_streams_take_their_engine_out_and_tell_the_scheduler():
    config = _config()
    registry = EngineRegistry([EngineState(name, f"http://{name}", config.roles[role].pool) for name, role in ENGINES])
    told = []
    metrics = SimpleNamespace(engine_healthy=SimpleNamespace(labels=lambda engine_id: SimpleNamespace(set=lambda value: None)))
    worker = SimpleNamespace(config=config, registry=registry, metrics=metrics, guards=set(),
                             report_out_of_service=lambda engine, why, stalled: told.append((engine.id, stalled)))
    limit_s = config.gateway.stall_timeout_s * SILENCE_SHARE_OF_STALL
    registry["sp0"].open_streams, registry["sp0"].last_byte_s = 2, 100.0  # silent since 100 s
    registry["sp1"].open_streams, registry["sp1"].last_byte_s = 1, 100.0 + limit_s  # a byte later
    registry["lp0"].last_byte_s = 0.0  # no open stream: nothing to hear from it
    check_silence(worker, 100.0 + limit_s + 0.01)
    assert told == [("sp0", True)]
    assert registry["sp0"].stalled and registry["sp0"].healthy and not registry["sp1"].stalled and not registry["lp0"].stalled
    check_silence(worker, 100.0 + 2 * limit_s + 0.01)  # sp0 is out already: told once; sp1 is silent now too
    assert told == [("sp0", True), ("sp1", True)]


async def test_in_pd_the_scheduler_picks_the_decode_engine_and_keeps_both_sides_load_as_one_process_does(tmp_path):
    config = pd_config(controller={"enabled": False})
    clock = Clock()
    registry = EngineRegistry([EngineState(e.name, f"http://{e.name}", config.pool(e)) for e in config.engines])
    prefix_index = PrefixCaches(PrefixIndex(config.scheduling.prefix_block_tokens, 4096))
    first_tokens = FirstTokenWindow(60.0)
    dispatcher = Dispatcher(make_scheduler(config.scheduling, engine_traits(config)), registry, clock=clock, first_tokens=first_tokens,
                            classify=partial(classify, config=config, registry=registry, prefix_index=prefix_index,
                                             classifier=make_classifier(config.scheduling)),
                            prefills=prefix_index.in_flight)
    aborted = []

    async def abort(url, rid):
        aborted.append((url, rid))

    side = SimpleNamespace(config=config, dispatcher=dispatcher, prefix_index=prefix_index, registry=registry, context_tokens=None,
                           client=SimpleNamespace(abort=abort), manager=None, engine_roles=None,
                           pd=PDDispatch(make_decode_placement(config.scheduling)))
    service = SchedulerService(side, {})
    await service.start(str(tmp_path / "sched.sock"))
    channel = await ChannelClient.connect(tmp_path / "sched.sock")
    try:
        def in_flight():
            return {e.id: e.in_flight for e in registry if e.in_flight}

        remote = RemoteDispatcher(channel)
        mirror = registry_of((await channel.call({"op": "state"}))["engines"])
        decode_side = RemoteDecodeSide(channel, remote, {})
        chain = BlockChain(config.scheduling.prefix_block_tokens).extend(range(3000))  # long: no AWD window
        first, prefill = await remote.place(Arrival("r1", chain, 1000.0, None, max_tokens=64))
        second, spilled = await remote.place(Arrival("r2", chain, 1000.0, None, max_tokens=64))
        assert (prefill, spilled) == ("pl0", "ps0")  # the long engine is busy: the idle short one takes it
        assert remote.decode_of == {"r1": "d0", "r2": "d1"}  # least_load: the idle one, then the other
        assert in_flight() == {"pl0": 1, "ps0": 1, "d0": 1, "d1": 1}
        assert decode_side.take_decode(mirror, "r1", first.prompt_tokens, False, clock()) == "d0"
        assert remote.decode_of == {"r2": "d1"}
        assert mirror["d0"].in_flight == 0  # the scheduler counts it (the worker's mirror shows that as of its last poll)

        remote.first_token("r1", "pl0", 0, load_ends=True)  # the prefill engine answered: its load ends there
        decode_side.decoding(None, "r1", "d0", clock(), late=True)  # the first decoded token came after the deadline
        await channel.call({"op": "state"})
        assert in_flight() == {"ps0": 1, "d0": 1, "d1": 1}
        assert first_tokens.violation_share("d0", clock()) == 1.0
        remote.complete(first, "pl0")
        await channel.call({"op": "state"})
        assert in_flight() == {"ps0": 1, "d1": 1}

        for engine_id in ("d0", "d1"):
            registry[engine_id].healthy = False
        with pytest.raises(APIError) as refused:
            await remote.place(Arrival("r3", chain, 1000.0, None, max_tokens=64))
        assert (refused.value.status, refused.value.code) == (503, "no_engine")
        assert in_flight() == {"ps0": 1, "d1": 1}  # the prefill engine chosen for r3 was released

        await channel.close()  # the worker died with r2 on ps0 and d1
        while len(aborted) < 2:
            await asyncio.sleep(0.01)
        assert sorted(aborted) == [("http://d1", "r2"), ("http://ps0", "r2")]
        assert in_flight() == {} and second.rid == "r2"
    finally:
        await channel.close()
        await service.close()
        dispatcher.close()


async def test_a_lost_scheduler_marks_the_workers_engines_unhealthy_at_once_not_at_the_next_poll(tmp_path):
    side = _scheduler_side(_config(), Clock())
    service = SchedulerService(side, {})
    await service.start(str(tmp_path / "sched.sock"))
    channel = await ChannelClient.connect(tmp_path / "sched.sock")
    try:
        state = await channel.call({"op": "state"})
        mirror = registry_of(state["engines"])
        poller = StatePoller(channel, mirror, state)
        assert all(e.healthy for e in mirror)
        await service.close()  # as the kernel closes a killed scheduler's sockets
        loop = asyncio.get_running_loop()
        lost_s = loop.time()
        while any(e.healthy for e in mirror):
            await asyncio.sleep(0.005)
        assert loop.time() - lost_s < STATE_POLL_S / 2
        await poller.close()
    finally:
        await channel.close()
        side.dispatcher.close()


async def test_a_worker_serves_again_through_a_scheduler_started_again_with_its_engines_new_urls(tmp_path):
    """The worker's channel reconnects by itself; its poller asks for the state at once and takes the new scheduler's
    engine URLs (its engines start on new ports) and health."""
    path = str(tmp_path / "sched.sock")
    first = _scheduler_side(_config(), Clock())
    service = SchedulerService(first, {})
    await service.start(path)
    channel = await ChannelClient.connect(path, reconnect=True)
    second = _scheduler_side(_config(), Clock())
    for engine in second.registry:
        engine.url += ":8001"
    again = SchedulerService(second, {})
    try:
        state = await channel.call({"op": "state"})
        mirror = registry_of(state["engines"])
        poller = StatePoller(channel, mirror, state)
        await service.close()
        while any(e.healthy for e in mirror):
            await asyncio.sleep(0.005)
        await again.start(path)
        loop = asyncio.get_running_loop()
        back_s = loop.time()
        while not all(e.healthy for e in mirror):
            await asyncio.sleep(0.005)
        assert loop.time() - back_s < STATE_POLL_S  # at once, not at the next poll
        assert {e.id: e.url for e in mirror} == {e.id: e.url for e in second.registry}
        assert all(e.url.endswith(":8001") for e in mirror)
        await poller.close()
    finally:
        await _end_restart(channel, again, first, second)


async def _end_restart(channel, again, first, second) -> None:
    """Close a worker's ``channel``, the scheduler service started ``again`` and both schedulers' dispatchers."""
    await channel.close()
    await again.close()
    first.dispatcher.close()
    second.dispatcher.close()


def _metrics():
    """What :func:`gateway.health.take_out_of_service` uses of the gateway's metrics."""
    return SimpleNamespace(engine_healthy=SimpleNamespace(labels=lambda engine_id: SimpleNamespace(set=lambda value: None)))


async def test_what_a_request_of_a_dead_scheduler_sees_of_its_engine_is_no_news_of_the_new_one(tmp_path):
    """A worker's request placed before the scheduler died runs on an engine of that scheduler: its failure, its
    silence, its bytes concern that engine only, not the new scheduler's under the same id (it took that one out of
    service, in the worker and in the new scheduler, until the health poll)."""
    path = str(tmp_path / "sched.sock")
    config = _config()
    first, second = _scheduler_side(config, Clock()), _scheduler_side(config, Clock())
    for side in (first, second):
        side.metrics, side.guards, side.report_out_of_service = _metrics(), set(), None
    for engine in second.registry:
        engine.url += ":8001"
    service, again = SchedulerService(first, {}), SchedulerService(second, {})
    await service.start(path)
    channel = await ChannelClient.connect(path, reconnect=True)
    try:
        state = await channel.call({"op": "state"})
        mirror = registry_of(state["engines"])
        poller = StatePoller(channel, mirror, state)
        worker = SimpleNamespace(config=config, registry=mirror, metrics=_metrics(), guards=set(),
                                 report_out_of_service=partial(report_out_of_service, channel))
        old = mirror["sp0"]  # as a request placed on sp0 now holds it
        old.open_streams, old.last_byte_s, old.stalled = 1, 0.0, True  # its stream, silent
        await service.close()
        await again.start(path)
        while not all(e.healthy and e.url.endswith(":8001") for e in mirror):
            await asyncio.sleep(0.005)
        new = mirror["sp0"]
        assert new is not old and old.url == "http://sp0" and (new.open_streams, new.stalled) == (0, False)
        engine_failed(worker, EngineUnavailable(old, f"{old.url}: ConnectionResetError"))
        check_silence(worker, 1e9)
        back_in_service(worker, old, "its stream brought bytes again")
        await channel.call({"op": "state"})  # the notes sent before it are handled
        assert new.serving and second.registry["sp0"].serving and old.stalled
        engine_failed(worker, EngineUnavailable(new, f"{new.url}: ConnectionResetError"))  # a request of the new one's
        await channel.call({"op": "state"})
        assert not new.healthy and not second.registry["sp0"].healthy
        await poller.close()
    finally:
        await _end_restart(channel, again, first, second)
