"""Prometheus metrics of the gateway (own registry: several gateways can live in one test process).

With several gateway processes (``gateway.workers`` > 1) the parent sets
``PROMETHEUS_MULTIPROC_DIR`` for its children, so prometheus-client keeps every
process's values in files there (its multiprocess mode) and any worker's
``/metrics`` reads them all (``MultiProcessCollector``): counters and histograms
add up; a gauge says how (``multiprocess_mode``: in-flight requests add up over
the live processes, health and pool state are the latest value any live
process set, memory budgets the largest).
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Buckets in seconds: short prefills finish in milliseconds, long ones and generations in seconds.
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 51.2)


class GatewayMetrics:
    """The gateway's metrics, labelled by request class (``short``/``long``) or engine.

    :meth:`watch_scheduler` adds the running scheduler's own state (queues, AWD depth, ...). ``registry`` is
    what ``/metrics`` exports: these metrics, or, in prometheus-client's multiprocess mode (module doc), every
    process's.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        multiprocess = "PROMETHEUS_MULTIPROC_DIR" in os.environ  # prometheus-client's own switch
        if multiprocess:
            MultiProcessCollector(self.registry)
        own = CollectorRegistry() if multiprocess else self.registry  # multiprocess: the values go to the files only
        self.requests = Counter("laps_requests", "Requests finished, by class and outcome", ["cls", "outcome"], registry=own)
        self.ttft = Histogram("laps_time_to_first_token_seconds", "Time to first token seen by the gateway, of streamed requests (a JSON answer arrives whole)", ["cls"], buckets=_LATENCY_BUCKETS_S, registry=own)
        self.e2e = Histogram("laps_e2e_request_latency_seconds", "End-to-end request latency", ["cls"], buckets=_LATENCY_BUCKETS_S, registry=own)
        self.prompt_tokens = Counter("laps_prompt_tokens", "Templated prompt tokens routed, by class", ["cls"], registry=own)
        self.in_flight = Gauge("laps_engine_in_flight_requests", "Requests in flight per engine", ["engine"], multiprocess_mode="livesum", registry=own)
        self.engine_healthy = Gauge("laps_engine_healthy", "1 if the engine answers /ready", ["engine"], multiprocess_mode="livemostrecent", registry=own)
        self.reprefills = Counter("laps_reprefills", "Requests with an estimated prefix-cache hit (H > 0), by class", ["cls"], registry=own)
        self.cached_estimated = Counter("laps_prefix_cached_tokens_estimated", "Prompt tokens the prefix index estimated cached on the chosen engine, by class", ["cls"], registry=own)
        self.cached_reported = Counter("laps_prefix_cached_tokens_reported", "Prompt tokens the engines reported served from their prefix cache (usage cached_tokens), by class", ["cls"], registry=own)
        self.prefix_estimate_error = Histogram(
            "laps_prefix_estimate_error_tokens", "|estimated - engine-reported| cached prompt tokens, per request", ["cls"],
            buckets=(0, 16, 64, 256, 1024, 4096, 16384), registry=own)
        self.client_aborts = Counter("laps_client_disconnects", "Requests whose client went away before the end", ["cls"], registry=own)
        self.pool_engines = Gauge("laps_pool_engines", "Engines serving each pool (healthy, not switching) at the controller's last decision", ["pool"], multiprocess_mode="livemostrecent", registry=own)
        self.pool_pressure = Gauge("laps_pool_pressure", "The controller's pool pressure (P90 of its engines' pressures; NaN: no engine)", ["pool"], multiprocess_mode="livemostrecent", registry=own)
        self.controller_moves = Counter("laps_controller_moves", "Engines the controller moved between pools, by outcome (ok, failed)", ["from_pool", "to_pool", "outcome"], registry=own)
        self.api_key_requests = Counter("laps_api_key_requests", "Requests accepted, by client API key label", ["key"], registry=own)
        self.memory_budget = Gauge("laps_memory_budget_bytes", "Configured memory budgets of the gateway's caches (prefix_index, chat_cache)", ["cache"], multiprocess_mode="max", registry=own)
        self.kv_event_batches = Counter("laps_kv_event_batches", "KV cache event batches applied to the exact prefix cache, per engine", ["engine"], registry=own)
        self.kv_event_gaps = Counter("laps_kv_event_gaps", "KV event sequence gaps seen, per engine", ["engine"], registry=own)
        self.kv_event_replays = Counter("laps_kv_event_replays", "KV event replays asked for, per engine", ["engine"], registry=own)
        self.kv_event_resets = Counter("laps_kv_event_resets", "Exact prefix caches reset (publisher restart, events out of step), per engine", ["engine"], registry=own)
        self.kv_event_bad_frames = Counter("laps_kv_event_bad_frames", "Malformed KV event messages, per engine", ["engine"], registry=own)
        self.kv_events_exact = Gauge("laps_kv_events_exact", "1 while the engine's prefix hits come from its KV events, 0 while estimated", ["engine"], multiprocess_mode="livemostrecent", registry=own)
        self._classes: dict[str, ClassMetrics] = {}
        self._in_flight: dict[str, Gauge] = {}

    def of_class(self, cls: str) -> "ClassMetrics":
        """The children of the per-class metrics for request class ``cls``, looked up once and then kept
        (``labels()`` validates and locks on every call: ~4% of a request's gateway CPU)."""
        children = self._classes.get(cls)
        if children is None:
            children = self._classes[cls] = ClassMetrics(self, cls)
        return children

    def in_flight_of(self, engine_id: str) -> Gauge:
        """The ``laps_engine_in_flight_requests`` child of ``engine_id``, looked up once and then kept."""
        child = self._in_flight.get(engine_id)
        if child is None:
            child = self._in_flight[engine_id] = self.in_flight.labels(engine_id)
        return child

    def watch_scheduler(self, stats: Callable[[], dict[str, float]]) -> None:
        """Export ``stats()`` (a scheduler's :meth:`stats`) on every scrape."""
        self.registry.register(SchedulerCollector(stats))


class ClassMetrics:
    """The per-class metrics' children of one request class (``cls``): ``ttft``, ``e2e``, ``prompt_tokens``,
    ``reprefills``, ``cached_estimated``, ``cached_reported``, ``prefix_estimate_error``, ``client_aborts``, and
    :meth:`requests` by outcome."""

    def __init__(self, metrics: GatewayMetrics, cls: str) -> None:
        self._requests = metrics.requests
        self._cls = cls
        self._by_outcome: dict[str, Counter] = {}
        self.ttft = metrics.ttft.labels(cls)
        self.e2e = metrics.e2e.labels(cls)
        self.prompt_tokens = metrics.prompt_tokens.labels(cls)
        self.reprefills = metrics.reprefills.labels(cls)
        self.cached_estimated = metrics.cached_estimated.labels(cls)
        self.cached_reported = metrics.cached_reported.labels(cls)
        self.prefix_estimate_error = metrics.prefix_estimate_error.labels(cls)
        self.client_aborts = metrics.client_aborts.labels(cls)

    def requests(self, outcome: str) -> Counter:
        """The ``laps_requests`` child of this class and ``outcome`` (``ok``, ``http_<status>``, ...)."""
        child = self._by_outcome.get(outcome)
        if child is None:
            child = self._by_outcome[outcome] = self._requests.labels(self._cls, outcome)
        return child


class SchedulerCollector(Collector):
    """Exports a scheduler's :meth:`~policies.scheduler.Scheduler.stats` at scrape time as ``laps_scheduler_<name>``
    (a counter when the name ends in ``_total``, else a gauge)."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        for name, value in self._stats().items():
            if name.endswith("_total"):  # counts since start
                base = name.removesuffix("_total")
                yield CounterMetricFamily(f"laps_scheduler_{base}", f"scheduler: {base.replace('_', ' ')}", value=value)
            else:
                yield GaugeMetricFamily(f"laps_scheduler_{name}", f"scheduler state: {name.replace('_', ' ')}", value=value)
