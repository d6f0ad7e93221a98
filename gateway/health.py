"""Engine health: the ``/ready`` poll, stalled-stream detection, and taking an engine out of service.

An engine leaves service (no new work goes to it) in four ways:

* the health poll (every ``HEALTH_POLL_INTERVAL_S``): ``GET /ready`` fails or
  times out (a dead or frozen process) -> ``healthy`` false until it answers;
  a probe that times out on an engine whose answers brought bytes in the last
  ``BUSY_WITHIN_S`` is a busy engine, not a dead one: it needs
  ``READY_FAILURES_WHEN_BUSY`` such polls in a row;
* its streams go silent: it has streams past their first byte and none has
  brought a byte for ``gateway.stall_timeout_s`` / 3 (an engine that still
  answers ``/ready`` but whose scheduler is stuck), or a request on it hit its
  first-byte or stall timeout (:mod:`gateway.guard`) while none of its streams
  brought a byte for that long (a busy engine queueing requests is not stuck)
  -> ``stalled``;
* it has requests waiting on it and has brought nothing for that long since the
  oldest of them was sent (no stream to watch: non-streamed answers, or streams
  before their first byte), or a request on it timed out while its other
  streams still brought bytes (new streams' first events can keep an engine
  that stalls every stream after them from ever looking silent), and a
  one-token generation (``GET /health_generate``) then fails or does not answer
  within the stall timeout -> ``stalled`` (without the probe a stuck engine
  holding only non-streamed requests would keep them until
  ``gateway.request_timeout_s``);
* a request could not reach it (connection refused or dropped) -> ``healthy``
  false until the next poll says otherwise.

Leaving service ends at once the wait of every request on the engine that has
sent its client nothing yet, so they are retried elsewhere. A stalled engine
comes back when it sends a byte on a stream again, or when a one-token
generation (``GET /health_generate``, SGLang's probe that runs the model)
answers within the stall timeout.
"""

from __future__ import annotations

import asyncio
import logging

from engines.client import EngineHTTPError, EngineTimedOut
from engines.manager import port_listeners
from gateway.errors import AnswerTooLong, EngineTimeout, EngineUnavailable
from gateway.registry import EngineState
from gateway.state import Gateway

log = logging.getLogger("laps.gateway")

HEALTH_POLL_INTERVAL_S = 1.0
# A /ready that times out on an engine that brought answer bytes within this many seconds is an engine too busy to
# answer the probe in time (its event loop full), not a dead one: it leaves service only after READY_FAILURES_WHEN_BUSY
# failed polls in a row (taking it out at once would send its whole queue elsewhere).
BUSY_WITHIN_S = 3.0
READY_FAILURES_WHEN_BUSY = 3
# The readiness of an engine this gateway runs whose process is not running (HealthMonitor._ready).
NOT_RUNNING = "process not running"
# The readiness of an engine this gateway runs whose port another process answers on (HealthMonitor._ready).
NOT_ITS_OWN = "answered by another process"
# An engine is stalled when its open streams have been silent for this share of the stall timeout: a frozen engine is
# noticed before its requests time out one by one.
SILENCE_SHARE_OF_STALL = 1 / 3


def registered(gw: Gateway, engine: EngineState) -> bool:
    """Whether ``engine`` is the state ``gw``'s registry holds under its id: not in a gateway worker whose request was
    placed on an engine of a scheduler process that died since (the engines of the one started again are other
    processes, with states of their own: :meth:`gateway.sched_worker.MirrorRegistry.renew`)."""
    return gw.registry[engine.id] is engine


def take_out_of_service(gw: Gateway, engine: EngineState, why: str, stalled: bool) -> None:
    """Route no new work to ``engine`` (``stalled``: set :attr:`~EngineState.stalled`, else clear ``healthy``) and
    end the wait of its requests that have sent nothing to their client, so they are retried elsewhere. An engine no
    longer :func:`registered` is left as it is (it went with its scheduler; the one under its id now is another)."""
    if not registered(gw, engine):
        return
    was_serving = engine.serving
    if stalled:
        engine.stalled = True
    else:
        engine.healthy = False
    gw.metrics.engine_healthy.labels(engine.id).set(0)
    if was_serving:
        log.warning("engine %s is out of service: %s", engine.id, why)
        if gw.report_out_of_service is not None:  # a gateway worker: the scheduler process decides where work goes
            gw.report_out_of_service(engine, why, stalled)
    end_waits_on(gw, engine)


def end_waits_on(gw: Gateway, engine: EngineState) -> None:
    """End the wait of every request of ``gw`` on ``engine`` that has sent its client nothing yet (it is retried
    elsewhere): the engine left service, here or, for a gateway worker, in the scheduler process."""
    for guard in list(gw.guards):
        guard.engine_down(engine)


def engine_failed(gw: Gateway, err: EngineUnavailable) -> None:
    """A request saw ``err`` from its engine: take the engine out of service (unhealthy), or after a first-byte or
    stall timeout (stalled) unless the engine's streams brought bytes within the silence limit: a busy engine that
    queues a request is no stuck engine (taking it out would send all its queue elsewhere). A timeout that does not
    take it out, and an answer past ``gateway.request_timeout_s`` (:class:`~gateway.errors.AnswerTooLong`), have it
    probed (:func:`check_waits`)."""
    engine = err.engine  # the one the request ran on (take_out_of_service leaves it if it is no longer registered)
    if not engine.serving:  # out of service already (the error may be the one its leaving caused)
        return
    now = asyncio.get_running_loop().time()
    if not isinstance(err, EngineTimeout):
        take_out_of_service(gw, engine, err.detail, stalled=False)
    elif not isinstance(err, AnswerTooLong) and now - engine.last_byte_s > silence_s(gw):  # AnswerTooLong: may only be slow
        take_out_of_service(gw, engine, err.detail, stalled=True)
    else:
        engine.timed_out_s = now  # slow, busy or partly stuck: its generation probe decides (check_waits)


def check_silence(gw: Gateway, now: float) -> None:
    """Take out of service (stalled) every engine of ``gw`` whose open streams have all brought nothing for longer than
    :func:`silence_s` (``now``: the event loop's time)."""
    limit_s = silence_s(gw)
    for engine in gw.registry:
        if engine.open_streams and not engine.stalled and now - engine.last_byte_s > limit_s:
            take_out_of_service(gw, engine, f"its {engine.open_streams} open streams brought nothing for {now - engine.last_byte_s:.1f} s", stalled=True)


async def watch_silence(gw: Gateway) -> None:
    """:func:`check_silence` and :func:`check_waits` every ``HEALTH_POLL_INTERVAL_S``, forever: a gateway
    worker's (``gateway.workers`` > 1), whose requests only it sees; the scheduler process, told of an engine it takes
    out, polls and probes it as :class:`HealthMonitor` does and brings it back."""
    loop = asyncio.get_running_loop()
    probes = GenerationProbes(gw)
    try:
        while True:
            await asyncio.sleep(HEALTH_POLL_INTERVAL_S)
            check_silence(gw, loop.time())
            check_waits(gw, probes, loop.time())
    finally:
        await probes.close()


def silence_s(gw: Gateway) -> float:
    """How long an engine's open streams may all be silent before the engine counts as stalled (seconds)."""
    return gw.config.gateway.stall_timeout_s * SILENCE_SHARE_OF_STALL


def back_in_service(gw: Gateway, engine: EngineState, why: str) -> None:
    """A stalled ``engine`` works again (``why``): route to it again (if it is still :func:`registered`)."""
    if engine.stalled and registered(gw, engine):
        engine.stalled = False
        log.warning("engine %s is back in service: %s", engine.id, why)
        gw.metrics.engine_healthy.labels(engine.id).set(int(engine.healthy))


def check_waits(gw: Gateway, probes: "GenerationProbes", now: float) -> None:
    """Probe every serving engine of ``gw`` that has requests of this process waiting on it (a guard watching it, the
    client sent nothing yet) and has brought no byte for longer than :func:`silence_s` since the oldest of them was sent
    and since its last probe answered (``now``: the event loop's time; streams past their first byte are
    :func:`check_silence`'s), or on which a request timed out since its last probe answered while it was not silent
    (:func:`engine_failed`)."""
    limit_s = silence_s(gw)
    oldest: dict[str, float] = {}
    waiting: dict[str, int] = {}
    for guard in gw.guards:
        for engine in (guard.engine, guard.also):
            if engine is not None and not guard.sent:
                oldest[engine.id] = min(oldest.get(engine.id, guard.since_s), guard.since_s)
                waiting[engine.id] = waiting.get(engine.id, 0) + 1
    for engine in gw.registry:
        if not engine.serving:
            continue
        answered_s = probes.answered_s.get(engine.id, 0.0)
        if engine.timed_out_s > answered_s:
            probes.start(engine, "a request on it timed out while it still sent bytes")
        elif engine.id in oldest:
            quiet_s = now - max(engine.last_byte_s, oldest[engine.id], answered_s)
            if quiet_s > limit_s:
                probes.start(engine, f"its {waiting[engine.id]} waiting requests brought nothing for {quiet_s:.1f} s")


class GenerationProbes:
    """The one-token generations (``GET /health_generate``, SGLang's probe that runs the model) one gateway process
    runs, at most one per engine at a time: on a stalled engine, to bring it back when it answers; on a serving one
    whose waiting requests brought nothing, or on which a request timed out (:func:`check_waits`), to take it out of
    service (stalled) when it fails it or does not answer within ``gateway.stall_timeout_s``."""

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw
        self._tasks: dict[str, asyncio.Task] = {}
        self.answered_s: dict[str, float] = {}  # engine -> when its last probe answered (the event loop's time)

    def start(self, engine: EngineState, why: str) -> None:
        """Probe ``engine`` (``why``: what the log says if a serving engine fails it), unless a probe of it runs."""
        if engine.id not in self._tasks:
            self._tasks[engine.id] = asyncio.ensure_future(self._probe(engine, why))

    async def _probe(self, engine: EngineState, why: str) -> None:
        gw = self._gw
        timeout_s = gw.config.gateway.stall_timeout_s
        try:
            await gw.client.get(engine.url, "/health_generate", timeout_s=timeout_s)
        except EngineHTTPError as err:
            failure = f"no answer within {timeout_s:g} s" if isinstance(err, EngineTimedOut) else str(err)
            if engine.stalled:
                log.info("engine %s: generation probe failed (%s); still out of service", engine.id, failure)
            elif engine.serving:
                take_out_of_service(gw, engine, f"{why}, and a one-token generation failed ({failure})", stalled=True)
        else:
            self.answered_s[engine.id] = asyncio.get_running_loop().time()  # it runs: quiet counts afresh from now
            back_in_service(gw, engine, "a one-token generation answered")
        finally:
            del self._tasks[engine.id]

    async def close(self) -> None:
        """Cancel the probes in progress."""
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)


class HealthMonitor:
    """The health poll and the stalled-engine checks of one gateway (see the module docstring); ``run`` is the loop.

    Times are the event loop's (``loop.time()``), as :attr:`EngineState.last_byte_s` is.
    """

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw
        self._probes = GenerationProbes(gw)
        self._ready_failures: dict[str, int] = {}

    async def run(self, each_round=None) -> None:
        """Poll forever; ``each_round()`` runs after every round (the supervisor's check)."""
        while True:
            await asyncio.sleep(HEALTH_POLL_INTERVAL_S)
            await self.poll()
            if each_round is not None:
                each_round()

    async def poll(self) -> None:
        """One round: ``/ready`` of every engine, then the silence checks and the probes of stalled engines."""
        gw = self._gw
        engines = list(gw.registry)
        loop = asyncio.get_running_loop()
        for engine, state in zip(engines, await asyncio.gather(*(self._ready(e) for e in engines))):
            ok = state == "ready"
            failures = self._ready_failures[engine.id] = 0 if ok else self._ready_failures.get(engine.id, 0) + 1
            busy = state == "timeout" and loop.time() - engine.last_byte_s < BUSY_WITHIN_S
            if ok and not engine.healthy:
                log.info("engine %s is now healthy", engine.id)
                engine.healthy = True
            elif not ok and engine.healthy and (not busy or failures >= READY_FAILURES_WHEN_BUSY):
                why = "its process is not running" if state == NOT_RUNNING else f"GET /ready: {state} ({failures} time(s) in a row)"
                take_out_of_service(gw, engine, why, stalled=False)
            gw.metrics.engine_healthy.labels(engine.id).set(int(engine.serving))
        check_silence(gw, loop.time())
        check_waits(gw, self._probes, loop.time())
        for engine in engines:
            if engine.stalled and engine.healthy:
                self._probes.start(engine, "it stalled")

    async def _ready(self, engine: EngineState) -> str:
        """:meth:`~engines.client.EngineClient.ready` of ``engine``; for an engine this gateway runs, :data:`NOT_RUNNING`
        while its process is not running (crashed, a restart pending or under way) and :data:`NOT_ITS_OWN` for a ready
        answer, to an engine out of service, that no process of its own gave (:func:`~engines.manager.port_listeners`):
        another process that took its port."""
        manager = self._gw.manager
        process = manager.engines.get(engine.id) if manager is not None else None
        if process is not None and not process.alive():
            return NOT_RUNNING
        state = await self._gw.client.ready(engine.url)
        if state == "ready" and process is not None and not engine.healthy:
            owners = await asyncio.to_thread(port_listeners, process.port)  # reads /proc: off the event loop
            if owners is not None and process.process.pid not in owners:
                return NOT_ITS_OWN
        return state

    async def close(self) -> None:
        """Cancel the probes in progress."""
        await self._probes.close()
