"""The immediate scheduler's choices, and the live dispatcher carrying out scripted decisions."""

import asyncio
import math

import pytest

from gateway.dispatcher import Arrival, Dispatcher, classify
from gateway.errors import APIError
from gateway.registry import EngineRegistry, EngineState
from policies.in_flight_prefix import InFlightPrefills
from policies.pool_router import PoolRouter
from laps.config import DEFAULT_CONFIG_PATH, load_config
from policies.exact_prefix import PrefixCaches
from policies.prefix_index import BlockChain, PrefixIndex
from policies.registry import make_classifier
from policies.scheduler import ImmediateScheduler
from policies.types import Decision, Dispatch, EngineView, RequestView


@pytest.mark.parametrize(
    "engines, request_class, expected",
    [
        ([EngineView("a", "short", in_flight=2), EngineView("b", "short", in_flight=1)], "short", "b"),
        ([EngineView("a", "short", in_flight=1, in_flight_prompt_tokens=90), EngineView("b", "short", in_flight=1, in_flight_prompt_tokens=80)], "short", "b"),
        ([EngineView("a", "short"), EngineView("b", "short")], "short", "a"),
        ([EngineView("s", "short"), EngineView("l", "long", in_flight=9)], "long", "l"),
        ([EngineView("s", "short"), EngineView("l", "long", healthy=False)], "long", "s"),
        ([EngineView("s", "short", healthy=False)], "short", None),
    ],
)
def test_pool_router_without_hits_is_least_loaded(engines, request_class, expected):
    assert PoolRouter().select(engines, request_class) == expected


@pytest.mark.parametrize(
    "in_flight_b, hit_b, expected",
    [(0, 0, "a"), (1, 0, "a"), (1, 512, "b"), (2, 512, "a"), (2, 600, "b")],
)
def test_pool_router_trades_prefix_hit_against_load(in_flight_b, hit_b, expected):
    engines = [EngineView("a", "short", in_flight=0), EngineView("b", "short", in_flight=in_flight_b)]
    assert PoolRouter(tokens_per_request=256).select(engines, "short", {"b": hit_b}) == expected


def test_immediate_scheduler_spreads_one_decision_over_engines():
    scheduler = ImmediateScheduler()
    for i in range(3):
        scheduler.submit(RequestView(f"r{i}", 10, request_class="short"), now=0.0)
    decision = scheduler.decide([EngineView("a", "short"), EngineView("b", "short")], now=0.0)
    assert decision == Decision((Dispatch("a", ("r0",)), Dispatch("b", ("r1",)), Dispatch("a", ("r2",))))
    assert scheduler.decide([EngineView("a", "short")], now=0.0) == Decision()


def test_immediate_scheduler_rejects_without_healthy_engines_and_forgets_cancelled():
    scheduler = ImmediateScheduler()
    scheduler.submit(RequestView("gone", 10), now=0.0)
    scheduler.submit(RequestView("r", 10), now=0.0)
    scheduler.cancel("gone", now=0.1)
    assert scheduler.decide([EngineView("a", "short", healthy=False)], now=0.2) == Decision(rejected=("r",))


class ScriptedScheduler:
    """Holds requests until ``release_at``, then sends them all to engine ``a``; records the calls it gets."""

    def __init__(self, release_at: float) -> None:
        self.release_at = release_at
        self.pending: list[str] = []
        self.calls: list[tuple] = []

    def submit(self, request, now):
        self.pending.append(request.rid)

    def cancel(self, rid, now):
        self.calls.append(("cancel", rid))
        self.pending.remove(rid)

    def decide(self, engines, now):
        if now < self.release_at:
            return Decision(wake_at_s=self.release_at)
        rids, self.pending = tuple(self.pending), []
        return Decision((Dispatch("a", rids),) if rids else ())

    def on_first_token(self, rid, engine_id, now, reported):
        self.calls.append(("first_token", rid, reported))

    def on_complete(self, rid, engine_id, now):
        self.calls.append(("complete", rid))


async def test_dispatcher_wakes_at_the_scheduler_time_and_counts_load():
    loop = asyncio.get_running_loop()
    registry = EngineRegistry([EngineState("a", "http://a", "short")])
    scheduler = ScriptedScheduler(release_at=loop.time() + 0.05)
    dispatcher = Dispatcher(scheduler, registry, clock=loop.time)
    requests = [RequestView(f"r{i}", 5) for i in range(2)]
    engines = await asyncio.gather(*(dispatcher.admit(r) for r in requests))
    assert engines == ["a", "a"]
    assert loop.time() >= scheduler.release_at
    assert (registry["a"].in_flight, registry["a"].in_flight_prompt_tokens) == (2, 10)
    dispatcher.first_token("r0", "a", 3)
    for r in requests:
        dispatcher.complete(r, "a")
    assert registry["a"].in_flight == 0
    assert scheduler.calls == [("first_token", "r0", 3), ("complete", "r0"), ("complete", "r1")]


async def test_a_first_token_that_ends_the_engines_part_releases_its_load_once():
    """PD: the prefill engine's answer ends the request's load there, and the scheduler hears it complete there then
    (its queue model stops counting it as decoding on the prefill engine); its completion later tells nothing twice."""
    loop = asyncio.get_running_loop()
    registry = EngineRegistry([EngineState("a", "http://a", "short")])
    scheduler = ScriptedScheduler(release_at=0.0)
    dispatcher = Dispatcher(scheduler, registry, clock=loop.time)
    prefilled, plain = RequestView("p", 7), RequestView("q", 5)
    assert await asyncio.gather(dispatcher.admit(prefilled), dispatcher.admit(plain)) == ["a", "a"]
    dispatcher.first_token("p", "a", 0, load_ends=True)
    assert (registry["a"].in_flight, registry["a"].in_flight_prompt_tokens) == (1, 5)
    assert scheduler.calls == [("first_token", "p", 0), ("complete", "p")]
    dispatcher.first_token("p", "a", 0, load_ends=True)  # told again: nothing more ends
    assert (registry["a"].in_flight, registry["a"].in_flight_prompt_tokens) == (1, 5)
    dispatcher.complete(prefilled, "a")
    assert (registry["a"].in_flight, registry["a"].in_flight_prompt_tokens) == (1, 5)
    dispatcher.first_token("q", "a", 2)  # not PD: the request goes on counting until it completes
    dispatcher.complete(plain, "a")
    assert (registry["a"].in_flight, registry["a"].in_flight_prompt_tokens) == (0, 0)
    assert scheduler.calls == [("first_token", "p", 0), ("complete", "p"), ("first_token", "p", 0),
                               ("first_token", "q", 2), ("complete", "q")]


async def test_dispatcher_withdraws_a_cancelled_request_and_fails_rejected_ones():
    loop = asyncio.get_running_loop()
    registry = EngineRegistry([EngineState("a", "http://a", "short")])
    scheduler = ScriptedScheduler(release_at=loop.time() + 60)
    dispatcher = Dispatcher(scheduler, registry, clock=loop.time)
    task = asyncio.create_task(dispatcher.admit(RequestView("r", 5)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert scheduler.calls == [("cancel", "r")] and dispatcher.queued == 0
    dispatcher.close()

    rejecting = Dispatcher(ImmediateScheduler(), EngineRegistry([EngineState("a", "http://a", "short", healthy=False)]))
    with pytest.raises(APIError) as info:
        await rejecting.admit(RequestView("x", 5))
    assert info.value.status == 503


async def test_a_failing_scheduler_fails_waiting_requests_explicitly():
    class Broken(ScriptedScheduler):
        def decide(self, engines, now):
            raise RuntimeError("policy bug")

    dispatcher = Dispatcher(Broken(release_at=0.0), EngineRegistry([EngineState("a", "http://a", "short")]))
    with pytest.raises(APIError) as info:
        await dispatcher.admit(RequestView("r", 5))
    assert info.value.status == 500 and dispatcher.queued == 0


async def test_the_dispatcher_keeps_a_prefill_in_flight_from_dispatch_to_its_first_token_or_its_end():
    registry = EngineRegistry([EngineState("a", "http://a", "short")])
    prefills = InFlightPrefills(block_tokens=2)
    scheduler = ScriptedScheduler(release_at=math.inf)
    dispatcher = Dispatcher(scheduler, registry, prefills=prefills)
    doc = BlockChain(2).extend([1, 2, 3, 4, 5])
    first, second, withdrawn = RequestView("r0", 5), RequestView("r1", 5), RequestView("gone", 5)
    waiting = asyncio.ensure_future(dispatcher.admit(withdrawn, doc.keys))
    tasks = [asyncio.ensure_future(dispatcher.admit(r, doc.keys)) for r in (first, second)]
    await asyncio.sleep(0)
    assert len(prefills) == 0  # held by the scheduler: nothing prefills yet
    scheduler.release_at = 0.0
    waiting.cancel()  # its withdrawal makes the scheduler decide: the other two go
    assert await asyncio.gather(*tasks) == ["a", "a"]
    assert len(prefills) == 2 and prefills.shared_tokens("a", doc) == 4
    dispatcher.first_token("r0", "a", 0)
    dispatcher.complete(second, "a")  # failed before its first token
    assert len(prefills) == 0 and prefills.shared_tokens("a", doc) == 0
    dispatcher.close()


def test_a_view_carries_the_fixed_deadline_and_with_a_length_aware_objective_that_one_too():
    config = load_config(DEFAULT_CONFIG_PATH.parent / "examples" / "sim-h200x8.yaml")  # 0.4 s, and 0.06 s more per 1,000 new tokens
    registry = EngineRegistry([EngineState(e.name, f"http://{e.name}", config.pool(e)) for e in config.engines])
    index = PrefixCaches(PrefixIndex(16, 4096))
    chain = BlockChain(16).extend(range(20_000))
    index.insert("e0", chain.keys[:250])  # 4,000 tokens cached on e0: 16,000 new
    classifier = make_classifier(config.scheduling)
    view = classify(Arrival("r", chain, 10.0, None), config, registry, index, classifier)
    assert (view.new_tokens, view.deadline_s, view.length_deadline_s) == (16_000, 10.4, pytest.approx(10.0 + 0.4 + 0.96))
    own = classify(Arrival("r", chain, 10.0, 12.0), config, registry, index, classifier)  # the client's x-laps-slo-ttft-s
    assert (own.deadline_s, own.length_deadline_s) == (12.0, None)
    fixed_only = config.model_copy(update={"slo": config.slo.model_copy(update={"ttft_per_1k_new_tokens_s": None})})
    assert classify(Arrival("r", chain, 10.0, None), fixed_only, registry, index, classifier).length_deadline_s is None
