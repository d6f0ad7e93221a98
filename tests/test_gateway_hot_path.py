"""The per-request shortcuts of the gateway's hot path: request ids and the kept Prometheus children."""

from __future__ import annotations

import re

from gateway.handlers import next_request_id
from gateway.metrics import GatewayMetrics


def test_request_ids_share_a_random_process_prefix_and_never_repeat():
    ids = [next_request_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    prefixes = {rid.split("-")[0] for rid in ids}
    assert len(prefixes) == 1 and re.fullmatch(r"[0-9a-f]{16}", prefixes.pop())
    counters = [int(rid.split("-")[1], 16) for rid in ids]
    assert counters == list(range(counters[0], counters[0] + 1000))


def test_kept_children_count_in_the_labelled_series():
    metrics = GatewayMetrics()
    short = metrics.of_class("short")
    assert metrics.of_class("short") is short and metrics.of_class("long") is not short
    assert metrics.in_flight_of("sp0") is metrics.in_flight_of("sp0")
    short.requests("ok").inc()
    short.requests("ok").inc()
    short.requests("http_400").inc()
    short.prompt_tokens.inc(120)
    short.e2e.observe(0.3)
    metrics.in_flight_of("sp0").inc()
    value = metrics.registry.get_sample_value
    assert value("laps_requests_total", {"cls": "short", "outcome": "ok"}) == 2.0
    assert value("laps_requests_total", {"cls": "short", "outcome": "http_400"}) == 1.0
    assert value("laps_prompt_tokens_total", {"cls": "short"}) == 120.0
    assert value("laps_e2e_request_latency_seconds_count", {"cls": "short"}) == 1.0
    assert value("laps_engine_in_flight_requests", {"engine": "sp0"}) == 1.0
    assert value("laps_requests_total", {"cls": "long", "outcome": "ok"}) is None
