"""A gateway worker's side of several gateway processes: the dispatcher and prefix index it reaches over the channel.

A worker (``gateway.workers`` > 1, :mod:`gateway.workers`) runs the HTTP
handlers as one process does, with these in its :class:`~gateway.state.Gateway`:

- :class:`RemoteDispatcher`: the :class:`~gateway.dispatcher.Dispatcher`'s
  interface (``place``, ``first_token``, ``complete``, ``fail_waiting``,
  ``queued``) as calls and notes to the scheduler process
  (:mod:`gateway.sched_service` lists the messages);
- :class:`RemotePrefixIndex`: ``insert`` / ``observe`` as notes (the global
  index lives in the scheduler, which classifies every request against it);
- in a prefill-decode deployment, :class:`RemoteDecodeSide`: the decode engine
  the scheduler picked with the prefill engine, and the decode side's progress
  as notes (the decode placement and the controller live in the scheduler);
- a mirror of the scheduler's engine registry (URLs, pools, health, load),
  :class:`MirrorRegistry`, that :class:`StatePoller` refreshes every
  :data:`STATE_POLL_S` (and marks unserving once the scheduler is gone); an
  engine a worker sees fail is reported (:func:`report_out_of_service`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections.abc import Awaitable, Callable, Sequence

from gateway.dispatcher import Arrival
from gateway.errors import APIError
from gateway.registry import EngineRegistry, EngineState
from gateway.sched_channel import ChannelClient, ChannelClosed
from policies.pool_signals import FirstTokenWindow
from policies.types import RequestView

log = logging.getLogger("laps.gateway")

STATE_POLL_S = 0.5  # how often a worker refreshes its mirror of the engine registry and the scheduler's stats
# How long a worker that starts tries the scheduler's socket while nothing listens (seconds): one started just before
# the scheduler died waits for the next. Longer than gateway.workers.SHORT_LIFE_S, so one that gives up is started
# again at once when the scheduler is up, not after a delay.
CONNECT_WITHIN_S = 30.0


def _tell(channel: ChannelClient, message: dict) -> None:
    """Send a note; a lost channel drops it (the scheduler is gone: there is nobody to tell)."""
    with contextlib.suppress(ChannelClosed):
        channel.note(message)


def _key_bytes(keys: Sequence[int]) -> bytes:
    return (keys if isinstance(keys, array) and keys.typecode == "q" else array("q", keys)).tobytes()


def scheduler_gone() -> APIError:
    """The client's error when the scheduler process cannot be reached (HTTP 503)."""
    return APIError(503, "the gateway's scheduler is not reachable; retry later", type="service_unavailable", code="scheduler_unavailable")


class RemoteDispatcher:
    """The dispatcher of a worker: each :meth:`place` is a ``place`` call to the scheduler, the rest are notes.

    ``decode_of``: in PD, ``{rid: decode engine}`` of the requests placed and not yet taken by
    :meth:`RemoteDecodeSide.take_decode`.
    """

    first_tokens = None  # the controller runs in the scheduler process

    def __init__(self, channel: ChannelClient) -> None:
        self._channel = channel
        self.clock = time.monotonic  # the node's one clock: the scheduler's too
        self.decode_of: dict[str, str] = {}
        self._waiting: set[asyncio.Task] = set()
        self._ended_with: Callable[[], APIError] | None = None

    @property
    def queued(self) -> int:
        """This worker's requests waiting for their decision."""
        return len(self._waiting)

    async def place(self, arrival: Arrival) -> tuple[RequestView, str]:
        """As :meth:`gateway.dispatcher.Dispatcher.place`, decided by the scheduler process.

        Raises:
            APIError: the scheduler's rejection (503 no engine, 500 policy failure), 503 ``scheduler_unavailable``
                when the channel is lost, or :meth:`fail_waiting`'s error.
            asyncio.CancelledError: the caller went away; the scheduler is told to withdraw it.
        """
        chain = arrival.chain
        message = {"op": "place", "rid": arrival.rid, "keys": chain.keys.tobytes(), "ids": chain.ids.tobytes(), "arrival_s": arrival.arrival_s,
                   "deadline_s": arrival.deadline_s, "max_tokens": arrival.max_tokens, "reply_tokens": list(arrival.reply_tokens),
                   "stream": arrival.stream, "priority": arrival.priority}
        call = asyncio.ensure_future(self._channel.call(message))
        self._waiting.add(call)
        try:
            answer = await call
        except asyncio.CancelledError:
            _tell(self._channel, {"op": "done", "rid": arrival.rid})
            if self._ended_with is not None and not asyncio.current_task().cancelling():  # fail_waiting, not the client
                raise self._ended_with() from None
            raise
        except ChannelClosed:
            raise scheduler_gone() from None
        finally:
            self._waiting.discard(call)
        error = answer.get("error")
        if error is not None:
            raise APIError(error["status"], error["message"], type=error["type"], code=error["code"])
        if "decode" in answer:
            self.decode_of[arrival.rid] = answer["decode"]
        cached = answer["cached_by_engine"]
        view = RequestView(arrival.rid, chain.tokens, max(cached.values(), default=0), arrival.arrival_s, answer["deadline_s"], answer["class"],
                           cached, arrival.max_tokens, arrival.reply_tokens, arrival.stream, arrival.priority)
        return view, answer["engine"]

    def first_token(self, rid: str, engine_id: str, reported_cached_tokens: int | None, load_ends: bool = False) -> None:
        _tell(self._channel, {"op": "first", "rid": rid, "engine": engine_id, "cached": reported_cached_tokens, "ends": load_ends})

    def complete(self, request: RequestView, engine_id: str) -> None:
        self.decode_of.pop(request.rid, None)  # placed but never relayed (its client went away first)
        _tell(self._channel, {"op": "done", "rid": request.rid})

    def fail_waiting(self, error: Callable[[], APIError]) -> None:
        """End this worker's requests still waiting for their decision with an ``error()`` (shutting down)."""
        self._ended_with = error
        for call in list(self._waiting):
            call.cancel()

    def close(self) -> None:
        """Nothing to stop: the channel is the worker's to close."""


class RemotePrefixIndex:
    """What a worker's handlers tell the prefix index (``insert``, ``observe``), as notes to the scheduler's."""

    def __init__(self, channel: ChannelClient, block_tokens: int) -> None:
        self._channel = channel
        self.block_tokens = block_tokens

    def insert(self, engine_id: str, keys: Sequence[int]) -> None:
        _tell(self._channel, {"op": "insert", "engine": engine_id, "keys": _key_bytes(keys)})

    def insert_prefilled(self, engine_id: str, keys: Sequence[int], routed_cached_tokens: int) -> None:
        self.insert(engine_id, keys[routed_cached_tokens // self.block_tokens:])  # as PrefixIndex.insert_prefilled

    def observe(self, engine_id: str, keys: Sequence[int], reported_cached_tokens: int | None,
                routed_cached_tokens: int | None = None) -> None:
        _tell(self._channel, {"op": "observe", "engine": engine_id, "keys": _key_bytes(keys), "cached": reported_cached_tokens,
                              "routed": routed_cached_tokens})


class RemoteDecodeSide:
    """A worker's :attr:`gateway.state.Gateway.pd` (:class:`gateway.pd_setup.DecodeSide`): the decode engine is the
    one the scheduler picked with the prefill engine (``dispatcher``'s :attr:`RemoteDispatcher.decode_of`) and counts
    the request on, the decode side's first token is a ``decoding`` note, its end the ``done`` note the dispatcher
    sends. ``bootstrap``: as :attr:`gateway.pd_setup.PDDispatch.bootstrap`."""

    def __init__(self, channel: ChannelClient, dispatcher: RemoteDispatcher, bootstrap: dict[str, tuple[str, int]]) -> None:
        self._channel = channel
        self._dispatcher = dispatcher
        self.bootstrap = bootstrap

    def take_decode(self, registry: EngineRegistry, rid: str, prompt_tokens: int, stream: bool, now: float) -> str | None:
        return self._dispatcher.decode_of.pop(rid, None)

    def decoding(self, first_tokens: FirstTokenWindow | None, rid: str, decode_id: str, now: float, late: bool) -> None:
        _tell(self._channel, {"op": "decoding", "rid": rid, "late": late})

    def release_decode(self, registry: EngineRegistry, rid: str, decode_id: str, prompt_tokens: int, now: float) -> None:
        """Nothing: the scheduler ends the decode side at the request's ``done`` note."""


class MirrorRegistry(EngineRegistry):
    """A worker's copy of the scheduler's registry (:func:`registry_of`, :func:`apply_state`, :meth:`renew`). The
    scheduler counts every request's load, this worker's too (its place answers, ``first`` and ``done`` notes), so the
    copy counts nothing itself: :meth:`acquire` and :meth:`release` do nothing, and the load it shows is the
    scheduler's as of the last state poll."""

    def acquire(self, engine_id: str, prompt_tokens: int) -> None:
        """Nothing (class doc)."""

    def release(self, engine_id: str, prompt_tokens: int) -> None:
        """Nothing (class doc)."""

    def renew(self, engines: list[list]) -> None:
        """Hold new states of every engine, from a ``state`` call's ``engines`` (a scheduler process's first answer:
        its engines are other processes than the dead one's, under the same ids). The requests placed on the dead
        one's engines keep those engines' states, so what they see of them (a failure, silence, bytes) is not taken
        for news of the new engines (:func:`gateway.health.registered`; it took a new one out of service, here and in
        the scheduler)."""
        self._engines = {row[0]: EngineState(row[0], row[1], row[2]) for row in engines}
        apply_state(self, engines)


def registry_of(engines: list[list]) -> MirrorRegistry:
    """A worker's registry from the ``state`` call's engines (:mod:`gateway.sched_service`)."""
    registry = MirrorRegistry([])
    registry.renew(engines)
    return registry


def apply_state(registry: EngineRegistry, engines: list[list]) -> list[EngineState]:
    """Copy the scheduler's URLs (a scheduler started again starts its engines on new ports), pools, health and load
    into ``registry`` (this worker's streams' own fields stay); the engines that were healthy and not stalled here and
    no longer are (taken out of service by the scheduler or another worker: this worker's requests waiting on them
    must end too)."""
    left = []
    for (engine_id, url, pool, healthy, draining, stalled, in_flight, in_flight_prompt_tokens, kv_capacity_tokens,
         max_running_requests) in engines:
        e = registry[engine_id]
        if e.healthy and not e.stalled and not (healthy and not stalled):
            left.append(e)
        e.url, e.pool, e.healthy, e.draining, e.stalled = url, pool, healthy, draining, stalled
        e.in_flight, e.in_flight_prompt_tokens, e.kv_capacity_tokens = in_flight, in_flight_prompt_tokens, kv_capacity_tokens
        e.max_running_requests = max_running_requests
    return left


def admin_caller(channel: ChannelClient) -> Callable[[dict], Awaitable[dict]]:
    """:attr:`gateway.state.Gateway.admin` of a worker: an admin call to the scheduler; a lost channel answers with
    :func:`scheduler_gone`'s error."""
    async def call(message: dict) -> dict:
        try:
            return await channel.call(message)
        except ChannelClosed:
            err = scheduler_gone()
            return {"error": {"status": err.status, **err.body()["error"]}}
    return call


def report_out_of_service(channel: ChannelClient, engine: EngineState, why: str, stalled: bool) -> None:
    """Tell the scheduler that this worker took ``engine`` out of service (:func:`gateway.health.take_out_of_service`)."""
    _tell(channel, {"op": "down", "engine": engine.id, "why": why, "stalled": stalled})


class StatePoller:
    """Refreshes ``registry``, :attr:`roles` (each engine's role now: the worker's
    :attr:`gateway.state.Gateway.engine_roles`, updated in place) and :attr:`stats` (the scheduler's, for
    ``/metrics``) from the ``state`` call every :data:`STATE_POLL_S`; ``state`` is the first answer (already applied
    to ``registry``). ``left_service(engine)`` runs for each engine the scheduler reports out of service that was in
    service here (:func:`apply_state`): the worker ends its requests' waits on it
    (:func:`gateway.health.end_waits_on`). Once the channel is lost (the scheduler died, its engines with it), at once, every engine of
    ``registry`` is marked unhealthy: the worker's ``/health`` answers 503 ``unavailable``, as its requests get
    503 ``scheduler_unavailable``. When the channel is back (a scheduler started again), it polls at once, and the
    engines serve again as the new scheduler reports them, in new states (:meth:`MirrorRegistry.renew`)."""

    def __init__(self, channel: ChannelClient, registry: MirrorRegistry, state: dict,
                 left_service: Callable[[EngineState], None] = lambda engine: None) -> None:
        self._channel = channel
        self._registry = registry
        self._left_service = left_service
        self.roles: dict[str, str] = dict(state["roles"])
        self.stats: dict[str, float] = state["stats"]
        self._renew = False  # the next answer is a new scheduler's
        self._poll_now = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())
        channel.on_lost = self._scheduler_gone
        channel.on_restored = self._poll_now.set

    def _scheduler_gone(self, why: str) -> None:
        """The channel closed: the scheduler died, its engines with it (``/health`` says so from now)."""
        log.error("worker: %s; requests get 503 scheduler_unavailable until it is back", why)
        for engine in self._registry:
            engine.healthy = False
        self._renew = True

    async def _run(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that lands as the event is set,
            # and close would then wait for this loop forever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STATE_POLL_S):
                    await self._poll_now.wait()
            self._poll_now.clear()
            try:
                state = await self._channel.call({"op": "state"})
            except ChannelClosed:
                continue  # the scheduler is gone (_scheduler_gone has run); its successor restores the channel
            if self._renew:
                self._registry.renew(state["engines"])
                self._renew = False
                log.info("worker: the new scheduler's engines are in this worker's registry (%d of %d healthy)",
                         sum(e.healthy for e in self._registry), len(state["engines"]))
            else:
                for engine in apply_state(self._registry, state["engines"]):
                    self._left_service(engine)
            self.roles.update(state["roles"])
            self.stats = state["stats"]

    async def close(self) -> None:
        self._channel.on_lost = self._channel.on_restored = None  # the worker closes the channel itself next: not a lost scheduler
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
