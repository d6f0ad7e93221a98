"""The real-time driver of the simulated engine: one asyncio task steps an :class:`EngineCore` on the wall clock.

``result = core.step(now)``, sleep until the forward pass would end, then hand
each event to its request's queue (:class:`Track`); with no work the loop waits
on an :class:`asyncio.Event`. Back-to-back passes are laid on one timeline (a
pass starts where the previous one ended, unless the loop fell more than
:data:`MAX_LAG_S` behind), so timer granularity (uvloop: 1 ms) adds jitter to
deliveries but no drift. The clock is :func:`time.monotonic`. SGLang's
Prometheus metrics are kept here too. The virtual-time simulator drives the
same core without this loop (:mod:`loadgen.virtual`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engines.sim.faults import parse_fault
from engines.sim.args import ResolvedSim
from engines.sim.core import EngineCore, RequestEvent
from engines.sim.kv_publisher import KVEventPublisher
from engines.sim.pd_http import PDShell
from laps.tokenizer import ChatTokenizer

log = logging.getLogger("engines.sim")

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60)
MAX_LAG_S = 0.002  # a pass starting later than this after the previous one's end restarts the timeline


class EngineMetrics:
    """SGLang's Prometheus metrics in a registry of their own."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Any:
            return Histogram(name, doc, labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = counter("sglang:cached_tokens", "Number of cached prompt tokens.")
        self.num_requests = counter("sglang:num_requests", "The number of requests finished.")
        self.num_aborted_requests = counter("sglang:num_aborted_requests", "Number of requests aborted.")
        self.ttft = histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.")
        self.e2e = histogram("sglang:e2e_request_latency_seconds", "Histogram of end-to-end request latency.")
        self.queue_time = histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.")



@dataclass(slots=True)
class Track:
    """A submitted request on the HTTP side: its event queue, arrival time and state."""

    queue: asyncio.Queue[RequestEvent]
    arrival: float
    internal: bool
    first_token_at: float | None = None
    done: bool = False

    async def events(self) -> AsyncIterator[RequestEvent]:
        """The request's events as they are delivered, up to and including the finishing one."""
        while True:
            ev = await self.queue.get()
            yield ev
            if ev.finished:
                return


class SimEngine:
    """The running engine: core, forward-pass loop, request queues, metrics."""

    def __init__(self, sim: ResolvedSim, tokenizer: ChatTokenizer) -> None:
        self.sim = sim
        self.tokenizer = tokenizer
        self.core = EngineCore(sim.config, sim.latency, tokenizer, kv_events=sim.kv_events is not None)
        self.metrics = EngineMetrics(sim.served_model_name)
        self.ready = False
        self.startup_time = time.time()
        self.clock = time.monotonic
        self.last_output_s = -math.inf  # when the engine last put out a token (self.clock(); /health_generate's sign of life)
        self._tracks: dict[str, Track] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.pd: PDShell | None = None  # the KV hand-off of a --disaggregation-mode prefill/decode engine
        fault = parse_fault(sim.args.sim_fault)
        self.slowdown = 1.0 if fault is None else fault.slowdown  # --sim-fault slow:N
        self.kv_publisher: KVEventPublisher | None = None  # with --kv-events-config: where the cache's events go

    def publish_kv_events(self) -> None:
        """Send the prefix cache's events since the last call as one batch (SGLang publishes one per scheduler step)."""
        if self.kv_publisher is not None:
            self.kv_publisher.publish(self.core.take_kv_events())

    async def start(self) -> None:
        """Start the forward-pass loop."""
        self._task = asyncio.create_task(self._run(), name="sim-engine-loop")
        self._task.add_done_callback(self._loop_ended)
        self.ready = True

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """A crashed loop leaves no request hanging: all end with ``abort`` and /ready turns 503."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("engine loop crashed; ending %d requests with abort", len(self._tracks), exc_info=task.exception())
        self.ready = False
        for rid, track in self._tracks.items():
            if not track.done:
                track.done = True
                track.queue.put_nowait(RequestEvent(rid, (), 0, 0, 0, finish_reason="abort"))

    async def stop(self) -> None:
        """Stop the loop; unfinished requests end with ``abort``."""
        self.ready = False
        if self._task is not None and not self._task.done():  # a crashed loop was reported by _loop_ended
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._deliver(self.core.abort_all())

    def submit(self, rid: str, input_ids: list[int], max_new_tokens: int | None, ignore_eos: bool,
               stop: list[str], priority: int | None = None) -> Track:
        """Queue a request; its events arrive on the returned track's queue.

        Raises:
            ValueError: as :meth:`EngineCore.add_request` (bad lengths, duplicate rid).
        """
        if rid in self._tracks:
            raise ValueError(f"Duplicate request ID: {rid}")
        self.core.add_request(rid, input_ids, max_new_tokens, ignore_eos, stop, self.clock(), priority)
        track = self.open_track(rid)
        self._wake.set()
        return track

    def open_track(self, rid: str) -> Track:
        """A track for ``rid`` whose request reaches the core later (a decode engine's, once its KV arrived).

        Raises:
            ValueError: ``rid`` already has a track.
        """
        if rid in self._tracks:
            raise ValueError(f"Duplicate request ID: {rid}")
        track = Track(asyncio.Queue(), self.clock(), rid.startswith(HEALTH_CHECK_RID_PREFIX))
        self._tracks[rid] = track
        return track

    def add_transferred(self, rid: str, input_ids: list[int], max_new_tokens: int | None, ignore_eos: bool,
                        stop: list[str], priority: int | None = None) -> None:
        """Decode engine: ``rid``'s KV has arrived; hand it to the core (nothing if its client already left).

        Raises:
            ValueError: as :meth:`EngineCore.add_transferred_request`.
        """
        if rid not in self._tracks:
            return
        self.core.add_transferred_request(rid, input_ids, max_new_tokens, ignore_eos, stop, self.clock(), priority)
        self._wake.set()

    def finish_transfer(self, rid: str) -> bool:
        """Prefill engine: ``rid``'s KV transfer is done; its request ends. False when none was in flight."""
        event = self.core.finish_transfer(rid)
        if event is None:
            return False
        self._deliver([event])
        self._wake.set()  # its KV is now evictable cache: waiting requests may fit
        return True

    def deliver(self, events: Iterable[RequestEvent]) -> None:
        """Hand events made outside a forward pass (e.g. a failed KV hand-off's abort) to their tracks."""
        self._deliver(events)

    def abort(self, rid: str) -> bool:
        """Abort ``rid`` (its stream ends with ``abort``); False when it is not running here."""
        event = self.core.abort(rid) or (self.pd.cancel(rid) if self.pd is not None else None)
        if event is None:
            return False
        self._deliver([event])
        return True

    def abort_all(self) -> None:
        """Abort every request."""
        self._deliver(self.core.abort_all())

    def release(self, rid: str) -> None:
        """The handler of ``rid`` is done: abort it if unfinished (client gone) and forget it."""
        track = self._tracks.get(rid)
        if track is not None and not track.done:
            self.abort(rid)
        self._tracks.pop(rid, None)

    async def _run(self) -> None:
        planned: float | None = None  # where the previous pass ended on the timeline
        while True:
            if not self.core.has_work():
                self._wake.clear()
                await self._wake.wait()
                planned = None
                continue
            now = self.clock()
            start = planned if planned is not None and now - planned <= MAX_LAG_S else now
            result = self.core.step(start)
            self._deliver(result.admitted)  # first tokens of transferred requests stream as their pass starts
            if result.idle:  # nothing schedulable; an abort it made (if any) may free room
                self.publish_kv_events()
                self._deliver(result.events)
                if not result.events:
                    self._wake.clear()
                    await self._wake.wait()
                planned = None
                continue
            planned = start + (0.0 if self.sim.args.sim_zero_time else result.duration_s * self.slowdown)
            await asyncio.sleep(max(0.0, planned - self.clock()))
            self.publish_kv_events()
            self._deliver(result.events)

    def _deliver(self, events: Iterable[RequestEvent]) -> None:
        now = self.clock()
        m = self.metrics
        for ev in events:
            track = self._tracks.get(ev.rid)
            if track is None or track.done:
                continue
            self.last_output_s = now
            if ev.first_token:
                track.first_token_at = now
                if not track.internal:
                    m.ttft.observe(now - track.arrival)
                    if ev.queue_time_s is not None:
                        m.queue_time.observe(ev.queue_time_s)
            if not track.internal:
                m.generation_tokens.inc(len(ev.new_token_ids))
            if ev.finished:
                track.done = True
                if not track.internal:
                    self._account_finish(ev, track, now)
            track.queue.put_nowait(ev)
            if self.pd is not None:
                self.pd.on_event(ev)

    def _account_finish(self, ev: RequestEvent, track: Track, now: float) -> None:
        m = self.metrics
        m.num_requests.inc()
        m.prompt_tokens.inc(ev.prompt_tokens)
        m.cached_tokens.inc(ev.cached_tokens)
        m.e2e.observe(now - track.arrival)
        if ev.finish_reason == "abort":
            m.num_aborted_requests.inc()
        ttft = f"{(track.first_token_at - track.arrival) * 1e3:.1f}ms" if track.first_token_at else "-"
        log.info("finish rid=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d ttft=%s e2e=%.1fms reason=%s",
                 ev.rid, ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens, ttft,
                 (now - track.arrival) * 1e3, ev.finish_reason)

    def update_gauges(self) -> None:
        """Copy the core's load snapshot into the gauges (at scrape time)."""
        s = self.core.stats()
        m = self.metrics
        m.num_running_reqs.set(s.num_running_reqs)
        m.num_queue_reqs.set(s.num_waiting_reqs)
        m.num_used_tokens.set(s.num_used_tokens)
        m.token_usage.set(s.token_usage)
        m.cache_hit_rate.set(s.cache_hit_rate)
        m.gen_throughput.set(s.gen_throughput)


ENGINE = web.AppKey("engine", SimEngine)
