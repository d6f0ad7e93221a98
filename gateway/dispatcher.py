"""Carries out a pure :class:`~policies.scheduler.Scheduler`'s decisions on the event loop.

A handler awaits :meth:`Dispatcher.place` with the request as it arrived (an
:class:`Arrival`): the request is classified against the prefix index
(:func:`classify`) and waits until the scheduler dispatches it (the view and
the engine id come back) or rejects it (503). The dispatcher asks the
scheduler to decide after every event (arrival, cancel, first token,
completion) and at the time the scheduler last asked to be woken. With
several gateway processes the workers' :class:`gateway.sched_worker.RemoteDispatcher`
has the same interface and asks this one, in the scheduler process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from gateway.errors import APIError
from gateway.registry import EngineRegistry
from laps.config import Config
from policies.admission import classified_view_of_chain
from policies.classifier import Classifier
from policies.exact_prefix import PrefixCaches
from policies.in_flight_prefix import InFlightPrefills
from policies.pool_signals import FirstTokenWindow
from policies.prefix_index import BlockChain
from policies.scheduler import Scheduler
from policies.types import RequestView

log = logging.getLogger("laps.gateway")


@dataclass(slots=True)
class _Flight:
    """A dispatched request: the prompt tokens it counts on its engine (until ``counted`` ends), and its TTFT
    deadline until its first token is recorded (``None`` after, or without a first-token window)."""

    prompt_tokens: int
    deadline_s: float | None
    counted: bool = True


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request as the gateway has it before it is classified: what :func:`classify` needs to make its view.

    ``chain``: the templated prompt's tokens and prefix block keys; ``arrival_s``: ``time.monotonic()`` at arrival
    (one clock for every process of the node); ``deadline_s``: the client's TTFT deadline (the SLO header), ``None``
    for the configured SLO (``slo.ttft_s``, and the length-aware one too with ``slo.ttft_per_1k_new_tokens_s``);
    ``max_tokens``, ``reply_tokens``, ``stream``, ``priority``: as :class:`~policies.types.RequestView`'s.
    """

    rid: str
    chain: BlockChain
    arrival_s: float
    deadline_s: float | None
    max_tokens: int | None = None
    reply_tokens: tuple[int, ...] = ()
    stream: bool = True
    priority: int | None = None


def classify(arrival: Arrival, config: Config, registry: EngineRegistry, prefix_index: PrefixCaches, classifier: Classifier) -> RequestView:
    """The scheduler's view of ``arrival``: its cached tokens on each prefill engine of ``registry`` now from
    ``prefix_index`` (not on a PD deployment's decode engines: they hold prompts and replies that no prefill engine
    has), its class, its deadlines (the configured SLO's: ``slo.ttft_s`` and, when set, the length-aware one on its new
    tokens; the client's own instead, when it set one)."""
    deadline_s = arrival.deadline_s if arrival.deadline_s is not None else arrival.arrival_s + config.slo.ttft_s
    view = classified_view_of_chain(arrival.rid, arrival.chain, arrival.arrival_s, deadline_s, registry.prefill_ids(), prefix_index,
                                    classifier, arrival.max_tokens, arrival.reply_tokens)
    length_s = config.slo.length_deadline_s(arrival.arrival_s, view.new_tokens) if arrival.deadline_s is None else None
    return dataclasses.replace(view, length_deadline_s=length_s, stream=arrival.stream, priority=arrival.priority)


class Dispatcher:
    """The live runner of one scheduler; ``clock`` is ``time.monotonic`` unless a test injects one.

    With ``first_tokens`` (the pressure controller is on) every first token is
    recorded there with its engine and whether it missed the request's deadline.
    ``classify(arrival)``: the view :meth:`place` admits (:func:`classify` over the gateway's prefix index).
    ``prefills``: the prefix index's prefills in flight (``PrefixCaches.in_flight``), which this dispatcher starts when
    it dispatches a request entered with its prompt's block keys and ends at its first token or completion.
    """

    def __init__(self, scheduler: Scheduler, registry: EngineRegistry, clock=time.monotonic,
                 first_tokens: FirstTokenWindow | None = None, classify: Callable[[Arrival], RequestView] | None = None,
                 prefills: InFlightPrefills | None = None) -> None:
        self.scheduler = scheduler
        self.classify = classify
        self.prefills = prefills
        self.clock = clock
        self.first_tokens = first_tokens
        self._registry = registry
        self._flights: dict[str, _Flight] = {}  # dispatched requests not complete yet
        self._waiting: dict[str, tuple[RequestView, asyncio.Future[str], Sequence[int]]] = {}  # view, future, block keys
        self._timer: asyncio.TimerHandle | None = None

    @property
    def queued(self) -> int:
        """Requests submitted and not yet dispatched."""
        return len(self._waiting)

    def queued_requests(self) -> list[RequestView]:
        """The requests submitted and not yet dispatched."""
        return [request for request, _, _ in self._waiting.values()]

    async def place(self, arrival: Arrival) -> tuple[RequestView, str]:
        """Classify ``arrival`` and :meth:`admit` it; its view and the id of the engine it is dispatched to.

        Raises:
            APIError, asyncio.CancelledError: as :meth:`admit`.
        """
        view = self.classify(arrival)
        return view, await self.admit(view, arrival.chain.keys)

    async def admit(self, request: RequestView, keys: Sequence[int] = ()) -> str:
        """Submit ``request`` (its prompt's block ``keys``: see :meth:`enter`); return the id of the engine it is
        dispatched to.

        The request counts as in flight on that engine from this moment; the
        caller must call :meth:`complete` when it ends.

        Raises:
            APIError: 503 when the scheduler rejects it (no healthy engine).
            asyncio.CancelledError: the caller went away; the request is withdrawn.
        """
        future = self.enter(request, keys)
        try:
            return await future
        except asyncio.CancelledError:
            self.withdraw(request, future)
            raise

    def enter(self, request: RequestView, keys: Sequence[int] = ()) -> asyncio.Future[str]:
        """:meth:`admit` without a coroutine: submit ``request`` and decide at once; the future of the id of the engine
        it is dispatched to (already done when dispatched or rejected at once). Its exception: an
        :class:`~gateway.errors.APIError` (503 no engine, 500 the policy failed, or :meth:`fail_waiting`'s). Whoever
        stops waiting for it calls :meth:`withdraw`; a dispatched request counts as in flight until :meth:`complete`.
        ``keys``: the prompt's block keys, its prefill in flight in ``prefills`` from dispatch to first token (none: not
        recorded).
        """
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiting[request.rid] = (request, future, keys)
        self.scheduler.submit(request, self.clock())
        self._decide()
        return future

    def withdraw(self, request: RequestView, future: asyncio.Future[str]) -> None:
        """Nobody waits for ``future`` (from :meth:`enter`) any more: a request still waiting leaves the scheduler, one
        dispatched in the same instant (its result not yet taken) completes at once; ``future`` is cancelled."""
        if self._waiting.pop(request.rid, None) is not None:
            self.scheduler.cancel(request.rid, self.clock())
            self._decide()
        elif future.done() and not future.cancelled() and future.exception() is None:
            self.complete(request, future.result())
        future.cancel()

    def first_token(self, rid: str, engine_id: str, reported_cached_tokens: int | None, load_ends: bool = False) -> None:
        """The engine produced the request's first token (its prefill is done).

        ``load_ends``: the engine's part of the request ends with it (PD: the prefill engine answered, after the KV
        transfer; the decode engine carries on), so the request stops counting on ``engine_id``'s load and the scheduler
        hears ``on_complete`` for it now (as the simulator tells it at the transfer's end, :mod:`loadgen.virtual_pd`),
        and :meth:`complete` tells neither again.
        """
        if self.prefills is not None:
            self.prefills.end(rid)
        now = self.clock()
        flight = self._flights.get(rid)
        if flight is not None:
            if self.first_tokens is not None and flight.deadline_s is not None:
                self.first_tokens.record(engine_id, now, flight.deadline_s)
            flight.deadline_s = None
        self.scheduler.on_first_token(rid, engine_id, now, reported_cached_tokens)
        if flight is not None and load_ends and flight.counted:
            flight.counted = False
            self._registry.release(engine_id, flight.prompt_tokens)
            self.scheduler.on_complete(rid, engine_id, now)
        self._decide()

    def complete(self, request: RequestView, engine_id: str) -> None:
        """The request ended on ``engine_id`` (answered, failed or aborted)."""
        if self.prefills is not None:
            self.prefills.end(request.rid)
        flight = self._flights.pop(request.rid, None)
        if flight is None or flight.counted:  # not ended by a first token with ``load_ends``
            self._registry.release(engine_id, request.prompt_tokens)
            self.scheduler.on_complete(request.rid, engine_id, self.clock())
        self._decide()

    def fail_waiting(self, error: Callable[[], APIError]) -> None:
        """End every request still waiting to be dispatched with an ``error()`` (the gateway is shutting down)."""
        for rid, (_, future, _) in list(self._waiting.items()):
            self.scheduler.cancel(rid, self.clock())
            if not future.done():
                future.set_exception(error())
        self._waiting.clear()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _decide(self) -> None:
        now = self.clock()
        try:
            decision = self.scheduler.decide(self._registry.views(), now)
        except Exception:
            # A policy bug must not strand anyone: every waiting request fails explicitly.
            log.exception("scheduler %s failed; failing %d waiting requests", type(self.scheduler).__name__, len(self._waiting))
            for _, future, _ in self._waiting.values():
                if not future.cancelled():
                    future.set_exception(APIError(500, "the gateway's scheduler failed; see the gateway log", type="internal_error"))
            self._waiting.clear()
            return
        for group in decision.dispatches:
            for rid in group.rids:
                request, future, keys = self._waiting.pop(rid)
                if future.cancelled():  # its caller went away earlier in this loop turn, before :meth:`admit` withdrew it
                    self.scheduler.on_complete(rid, group.engine_id, now)
                    continue
                self._registry.acquire(group.engine_id, request.prompt_tokens)
                if self.prefills is not None and keys:
                    self.prefills.start(rid, group.engine_id, keys)
                self._flights[rid] = _Flight(request.prompt_tokens, request.deadline_s if self.first_tokens is not None else None)
                future.set_result(group.engine_id)
        for rid in decision.rejected:
            _, future, _ = self._waiting.pop(rid)
            if not future.cancelled():
                future.set_exception(APIError(503, "no healthy engine is available; retry later", type="service_unavailable", code="no_engine"))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if decision.wake_at_s is not None:
            self._timer = asyncio.get_running_loop().call_later(max(0.0, decision.wake_at_s - now), self._decide)
