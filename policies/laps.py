"""LAPS: length-aware prefill scheduling with Adaptive Wait-Depth (AWD) windows for short prefills.

Our reading of LAPS Algorithm 1 (DESIGN §2.4), per short-request group:

* depth = Σ L_i of the queued requests (new tokens); the target depth D is a
  prefill CUDA-graph token bucket (SGLang's ``--cuda-graph-bs-prefill`` buckets
  are token counts), so a dispatched batch fills a captured graph shape;
* W_SLA = max(0, min_i(DDL_i − t − Ŝ) − δ): how long the tightest deadline still allows;
* W_GR = max(0, D − depth) / max(r̂_s, ε): how long the batch needs to fill at the
  current short-token arrival rate r̂_s (an exponentially decaying rate);
* the window closes at t0 + clip((t − t0) + min(W_SLA, W_GR), [W_min, W_max]),
  t0 being the oldest queued arrival; when the batch cannot fill within W_max
  (t − t0 + W_GR > W_max) waiting buys no batching, so the window is W_min
  (our addition: at low load the formula alone would hold every request W_max);
* dispatch when depth >= D ("depth"), when the window closes ("window"), or when
  any request's slack DDL_i − t − Ŝ falls under σ ("slack");
* after each dispatch D adapts: filled in under half of W_max → one bucket up;
  window closed short of D → down to the largest bucket the queue reached;
  slack-forced → one bucket down. W adapts through W_GR and W_SLA.
  Ŝ, the short batch's dispatch-to-first-token time, is an EWMA of observations.

Grouping ("memory first"): one queue per length bucket (8/16/32/…/256 new
tokens) so a batch's sequences pad to similar lengths; "latency first": one queue.

Long prefills go to the long pool as soon as the engine's long prefills still
in progress (dispatched, no first token yet) leave room: their new tokens plus
the request's stay within ``max_long_prefill_tokens`` on a long-pool engine, or
``temporal_long_prefill_tokens`` on an engine that also takes short prefills
(temporal mode: by default one long prefill at a time, so a short batch never
queues behind several); one request is always let through, so long prefills run one or few at a time in large chunks and
queue in the gateway, not behind each other inside the engine. A queued long
request whose own slack DDL − t − Ŝ_long falls under σ goes at once, gate or
not (Ŝ_long: the EWMA of long dispatch-to-first-token times), so the gate
protects short prefills without starving long ones.

Temporal mode (one engine serving both classes, the ``mixed`` role) was decided
in the simulator (one simulated H200, Qwen2.5-7B, the mixed real-chat workload,
30 s per point): gating long prefills in the gateway alone halves short P90
TTFT at moderate load (49 vs 103 ms at 20 conversations/s, against least-load
FCFS) but collapses in overload (13% SLO violations at 40/s, 98% at 60/s),
because a short batch that arrives during a long prefill still waits for all
its chunks; SGLang's ``shortest-prefill-first`` alone does not separate the
classes. Together (the gate plus ``--schedule-policy shortest-prefill-first``
on the engine, which lets short prefills into the step after each long chunk)
they give 2.2% violations at 40/s and 6.4% at 60/s, against 4.0% and 97% for
least-load FCFS, with the same short P90 at moderate load. Where the LAPS paper's details are not public, the rules
above are ours; tests pin them down on scripted arrival sequences.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.pool_router import PoolRouter
from policies.types import Decision, Dispatch, EngineView, RequestView

Trigger = Literal["depth", "window", "slack"]
_EPS_RATE = 1e-9


class LapsConfig(BaseModel):
    """Parameters of :class:`LapsScheduler` (times in milliseconds, sizes in tokens)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    window_min_ms: float = Field(0.5, ge=0)
    window_max_ms: float = Field(8.0, gt=0)
    token_buckets: list[int] = Field(default_factory=lambda: [64, 128, 256, 512, 1024, 2048], min_length=1)
    initial_depth_tokens: int = 256
    slack_ms: float = Field(50.0, ge=0, description="σ: dispatch at once when a deadline is this close")
    margin_ms: float = Field(10.0, ge=0, description="δ: safety margin inside W_SLA")
    grouping: Literal["memory-first", "latency-first"] = "memory-first"
    length_buckets: list[int] = Field(default_factory=lambda: [8, 16, 32, 64, 128, 256], min_length=1)
    rate_window_s: float = Field(1.0, gt=0, description="time constant of the arrival-rate estimate")
    initial_service_ms: float = Field(10.0, gt=0, description="Ŝ before the first observation")
    initial_long_service_ms: float = Field(100.0, gt=0, description="Ŝ_long before the first observation")
    service_smoothing: float = Field(0.2, gt=0, le=1, description="EWMA weight of a new Ŝ observation")
    max_long_prefill_tokens: int = Field(16384, ge=1, description="new tokens of long prefills in progress per long-pool engine")
    temporal_long_prefill_tokens: int = Field(1, ge=1, description="the same on an engine that also serves short prefills (1: one at a time)")

    @model_validator(mode="after")
    def _check(self) -> "LapsConfig":
        if sorted(set(self.token_buckets)) != self.token_buckets or sorted(set(self.length_buckets)) != self.length_buckets:
            raise ValueError("token_buckets and length_buckets must be strictly increasing")
        if self.initial_depth_tokens not in self.token_buckets:
            raise ValueError(f"initial_depth_tokens {self.initial_depth_tokens} must be one of token_buckets {self.token_buckets}")
        if self.window_min_ms > self.window_max_ms:
            raise ValueError("window_min_ms must not exceed window_max_ms")
        return self


@dataclass
class _DecayingRate:
    """Events per second, exponentially decayed with time constant ``tau_s`` (weights are event sizes)."""

    tau_s: float
    value: float = 0.0
    last_s: float = 0.0

    def at(self, now: float) -> float:
        return self.value * math.exp(-(now - self.last_s) / self.tau_s)

    def add(self, now: float, weight: float) -> None:
        self.value = self.at(now) + weight / self.tau_s
        self.last_s = now


@dataclass
class _InFlight:
    engine_id: str
    short: bool
    dispatched_s: float
    new_tokens: int
    prefilling: bool = True


class LapsScheduler:
    """LAPS scheduler: AWD windows for short prefills, gated long prefills (see module docstring)."""

    NAME = "laps"

    def __init__(self, config: LapsConfig | None = None, router: PoolRouter | None = None) -> None:
        self.config = config or LapsConfig()
        self._router = router or PoolRouter()
        self._queues: dict[int, list[RequestView]] = defaultdict(list)
        self._long: list[RequestView] = []
        self.depth_tokens = self.config.initial_depth_tokens
        self.service_s = self.config.initial_service_ms / 1e3
        self.long_service_s = self.config.initial_long_service_ms / 1e3
        self._rate = _DecayingRate(self.config.rate_window_s)
        self._in_flight: dict[str, _InFlight] = {}
        self.triggers: dict[Trigger, int] = {"depth": 0, "window": 0, "slack": 0}
        self.requests_batched = 0

    # -- events -------------------------------------------------------------------------------

    def submit(self, request: RequestView, now: float) -> None:
        if request.request_class == "long":
            self._long.append(request)
            return
        self._queues[self._group(request)].append(request)
        self._rate.add(now, request.new_tokens)

    def cancel(self, rid: str, now: float) -> None:
        for queue in (self._long, *self._queues.values()):
            for i, r in enumerate(queue):
                if r.rid == rid:
                    del queue[i]
                    return

    def on_first_token(self, rid: str, engine_id: str, now: float, reported_cached_tokens: int | None) -> None:
        flight = self._in_flight.get(rid)
        if flight is None or not flight.prefilling:
            return
        flight.prefilling = False
        a = self.config.service_smoothing
        if flight.short:
            self.service_s = (1 - a) * self.service_s + a * (now - flight.dispatched_s)
        else:
            self.long_service_s = (1 - a) * self.long_service_s + a * (now - flight.dispatched_s)

    def on_complete(self, rid: str, engine_id: str, now: float) -> None:
        self._in_flight.pop(rid, None)

    def stats(self) -> dict[str, float]:
        """Queue depths, the adaptive depth D and service estimates (gauges); batch counts by trigger (``_total``: counters)."""
        return {
            "queued_short_requests": sum(len(q) for q in self._queues.values()),
            "queued_long_requests": len(self._long),
            "awd_depth_tokens": self.depth_tokens,
            "awd_service_estimate_seconds": self.service_s,
            "long_service_estimate_seconds": self.long_service_s,
            "short_batches_total": sum(self.triggers.values()),
            "short_requests_batched_total": self.requests_batched,
            **{f"short_batches_by_{trigger}_total": n for trigger, n in self.triggers.items()},
        }

    # -- decisions ----------------------------------------------------------------------------

    def decide(self, engines: Sequence[EngineView], now: float) -> Decision:
        load = {e.id: e for e in engines}
        if not any(e.healthy for e in engines):
            rejected = tuple(r.rid for q in (self._long, *self._queues.values()) for r in q)
            self._long.clear()
            self._queues.clear()
            return Decision(rejected=rejected)
        dispatches, wake = self._dispatch_long(load, now)
        for group in sorted(self._queues):
            queue = self._queues[group]
            while queue:
                trigger, when = self.trigger(queue, now)
                if trigger is None:
                    wake = when if wake is None else min(wake, when)
                    break
                dispatches.append(self._dispatch_short(queue, trigger, load, now))
        return Decision(tuple(dispatches), wake_at_s=wake)

    def trigger(self, queue: Sequence[RequestView], now: float) -> tuple[Trigger | None, float]:
        """Why ``queue`` must be dispatched at ``now``, or ``(None, time to look again)``."""
        c = self.config
        depth = sum(r.new_tokens for r in queue)
        if depth >= self.depth_tokens:
            return "depth", now
        slack = min(r.deadline_s for r in queue) - now - self.service_s
        if slack < c.slack_ms / 1e3:
            return "slack", now
        t0 = min(r.arrival_s for r in queue)
        w_sla = max(0.0, slack - c.margin_ms / 1e3)
        w_gr = max(0, self.depth_tokens - depth) / max(self._rate.at(now), _EPS_RATE)
        if (now - t0) + w_gr > c.window_max_ms / 1e3:
            window_s = c.window_min_ms / 1e3
        else:
            window_s = min(max((now - t0) + min(w_sla, w_gr), c.window_min_ms / 1e3), c.window_max_ms / 1e3)
        if now >= t0 + window_s:
            return "window", now
        slack_due = now + slack - c.slack_ms / 1e3
        return None, min(t0 + window_s, slack_due)

    def _group(self, request: RequestView) -> int:
        if self.config.grouping == "latency-first":
            return 0
        buckets = self.config.length_buckets
        return min(bisect.bisect_left(buckets, request.new_tokens), len(buckets) - 1)

    def _dispatch_short(self, queue: list[RequestView], trigger: Trigger, load: dict[str, EngineView], now: float) -> Dispatch:
        batch, tokens = [], 0
        while queue and (not batch or tokens + queue[0].new_tokens <= self.depth_tokens):
            tokens += queue[0].new_tokens
            batch.append(queue.pop(0))
        hits: dict[str, int] = defaultdict(int)
        for r in batch:
            for engine_id, h in r.cached_by_engine.items():
                hits[engine_id] += h
        engine_id = self._router.select(list(load.values()), "short", hits)
        waited_s = now - min(r.arrival_s for r in batch)
        self._adapt_depth(trigger, tokens, waited_s)
        self.triggers[trigger] += 1
        self.requests_batched += len(batch)
        self._account(load, engine_id, batch, short=True, now=now)
        return Dispatch(engine_id, tuple(r.rid for r in batch))

    def _adapt_depth(self, trigger: Trigger, batch_tokens: int, waited_s: float) -> None:
        buckets = self.config.token_buckets
        i = buckets.index(self.depth_tokens)
        if trigger == "depth" and waited_s <= self.config.window_max_ms / 2e3:
            i = min(i + 1, len(buckets) - 1)
        elif trigger == "window":
            i = max(0, min(i, bisect.bisect_right(buckets, batch_tokens) - 1))
        elif trigger == "slack":
            i = max(0, i - 1)
        self.depth_tokens = buckets[i]

    def _dispatch_long(self, load: dict[str, EngineView], now: float) -> tuple[list[Dispatch], float | None]:
        """Long requests the gate (or their slack) lets go now; and when the first held one runs out of slack."""
        dispatches = []
        # Without a healthy long pool (e.g. one engine in temporal mode), any engine takes long prefills.
        pool = "long" if any(e.healthy and e.pool == "long" for e in load.values()) else None
        limit = self.config.max_long_prefill_tokens if pool == "long" else self.config.temporal_long_prefill_tokens
        prefilling: dict[str, int] = defaultdict(int)
        for f in self._in_flight.values():
            if f.prefilling and not f.short:
                prefilling[f.engine_id] += f.new_tokens
        while self._long:
            request = self._long[0]
            candidates = [e for e in load.values() if pool in (None, e.pool)]
            slack_due_s = request.deadline_s - self.long_service_s - self.config.slack_ms / 1e3
            if now < slack_due_s:
                candidates = [e for e in candidates if prefilling[e.id] == 0 or prefilling[e.id] + request.new_tokens <= limit]
            engine_id = self._router.select(candidates, "long", request.cached_by_engine)
            if engine_id is None:
                return dispatches, (slack_due_s if now < slack_due_s else None)
            self._long.pop(0)
            prefilling[engine_id] += request.new_tokens
            self._account(load, engine_id, [request], short=False, now=now)
            dispatches.append(Dispatch(engine_id, (request.rid,)))
        return dispatches, None

    def _account(self, load: dict[str, EngineView], engine_id: str, batch: list[RequestView], short: bool, now: float) -> None:
        load[engine_id] = load[engine_id].with_dispatched(len(batch), sum(r.prompt_tokens for r in batch))
        for r in batch:
            self._in_flight[r.rid] = _InFlight(engine_id, short, now, r.new_tokens)
