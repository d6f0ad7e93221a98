"""Prometheus metrics of the gateway (own registry: several gateways can live in one test process)."""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Buckets in seconds: short prefills finish in milliseconds, long ones and generations in seconds.
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 51.2)


class GatewayMetrics:
    """The gateway's metrics, labelled by request class (``short``/``long``) or engine.

    :meth:`watch_scheduler` adds the running scheduler's own state (queues, AWD depth, ...).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("laps_requests", "Requests finished, by class and outcome", ["cls", "outcome"], registry=self.registry)
        self.ttft = Histogram("laps_time_to_first_token_seconds", "Time to first token seen by the gateway", ["cls"], buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.e2e = Histogram("laps_e2e_request_latency_seconds", "End-to-end request latency", ["cls"], buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.prompt_tokens = Counter("laps_prompt_tokens", "Templated prompt tokens routed, by class", ["cls"], registry=self.registry)
        self.in_flight = Gauge("laps_engine_in_flight_requests", "Requests in flight per engine", ["engine"], registry=self.registry)
        self.engine_healthy = Gauge("laps_engine_healthy", "1 if the engine answers /ready", ["engine"], registry=self.registry)
        self.reprefills = Counter("laps_reprefills", "Requests with an estimated prefix-cache hit (H > 0), by class", ["cls"], registry=self.registry)
        self.prefix_estimate_error = Histogram(
            "laps_prefix_estimate_error_tokens", "|estimated - engine-reported| cached prompt tokens, per request", ["cls"],
            buckets=(0, 16, 64, 256, 1024, 4096, 16384), registry=self.registry)
        self.client_aborts = Counter("laps_client_disconnects", "Requests whose client went away before the end", ["cls"], registry=self.registry)
        self.pool_engines = Gauge("laps_pool_engines", "Engines serving each pool (healthy, not switching) at the controller's last decision", ["pool"], registry=self.registry)
        self.pool_pressure = Gauge("laps_pool_pressure", "The controller's pool pressure (P90 of its engines' pressures; NaN: no engine)", ["pool"], registry=self.registry)
        self.controller_moves = Counter("laps_controller_moves", "Engines the controller moved between pools, by outcome (ok, failed)", ["from_pool", "to_pool", "outcome"], registry=self.registry)


    def watch_scheduler(self, stats: Callable[[], dict[str, float]]) -> None:
        """Export ``stats()`` (a scheduler's :meth:`stats`) on every scrape."""
        self.registry.register(SchedulerCollector(stats))

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
