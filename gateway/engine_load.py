"""Engine-reported load: SGLang's ``GET /v1/loads`` (JSON) and ``GET /metrics`` (Prometheus text) in one snapshot.

Both SGLang 0.5.23 and the simulated engine serve these routes (metrics only
with ``--enable-metrics``). The parsers are pure; :func:`fetch_engine_load`
reads both routes through the gateway's :class:`~engines.client.EngineClient`,
and :func:`read_capacity` puts an engine's KV pool and request slots on its
gateway state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

from engines.client import EngineClient
from gateway.registry import EngineState

if TYPE_CHECKING:
    from policies.exact_prefix import PrefixCaches

log = logging.getLogger("laps.gateway")

# /v1/loads per-rank keys summed into the snapshot.
_LOAD_KEYS = ("num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens", "num_used_tokens", "max_total_num_tokens")
# /metrics counters read into the snapshot (sample names).
_COUNTERS = (
    "sglang:num_requests_total",
    "sglang:num_aborted_requests_total",
    "sglang:prompt_tokens_total",
    "sglang:cached_tokens_total",
    "sglang:generation_tokens_total",
)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine's own account of its load, summed over its data-parallel ranks.

    From ``/v1/loads``: requests running and waiting, the uncached prompt
    tokens of the waiting ones, KV-cache tokens in use and the KV pool's size
    (tokens), the prefix-cache hit rate in [0, 1] (mean over ranks), and
    ``max_running_requests`` where every rank gives it (the simulated engine
    does; else ``None``).
    From ``/metrics``: counters since the engine started (requests finished,
    requests aborted, prompt tokens, prompt tokens served from the cache,
    generated tokens).
    """

    running_requests: int
    waiting_requests: int
    waiting_uncached_tokens: int
    used_tokens: int
    max_total_tokens: int
    cache_hit_rate: float
    requests_total: float
    aborted_requests_total: float
    prompt_tokens_total: float
    cached_tokens_total: float
    generation_tokens_total: float
    max_running_requests: int | None = None

    @property
    def token_usage(self) -> float:
        """Share of the KV pool in use, in [0, 1] (0 for an empty pool)."""
        return self.used_tokens / self.max_total_tokens if self.max_total_tokens else 0.0


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition, by sample name, summed over its label sets.

    Counters keep their ``_total`` sample names. Raises :class:`ValueError`
    when ``text`` is not in the Prometheus text format.
    """
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def engine_load(loads: Mapping[str, Any], metrics: Mapping[str, float]) -> EngineLoad:
    """The snapshot of a parsed ``/v1/loads`` body and :func:`parse_metrics` of ``/metrics``.

    A counter absent from ``metrics`` counts 0: SGLang exports a labelled
    counter only once it has been incremented (``num_aborted_requests_total``
    appears with the first abort).

    Raises:
        ValueError: ``loads`` has no ranks, or a rank lacks one of the fields read.
    """
    ranks = loads.get("loads") if isinstance(loads, Mapping) else None
    if not ranks:
        raise ValueError("/v1/loads: no 'loads' list of ranks")
    try:
        totals = {key: sum(int(rank[key]) for rank in ranks) for key in _LOAD_KEYS}
        hit_rate = sum(float(rank["cache_hit_rate"]) for rank in ranks) / len(ranks)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"/v1/loads: a rank lacks a numeric field: {err!r}") from None
    counters = [metrics.get(name, 0.0) for name in _COUNTERS]
    capacities = [rank.get("max_running_requests") for rank in ranks]
    capacity = sum(capacities) if all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in capacities) else None
    return EngineLoad(
        totals["num_running_reqs"], totals["num_waiting_reqs"], totals["num_waiting_uncached_tokens"], totals["num_used_tokens"],
        totals["max_total_num_tokens"], hit_rate, *counters, capacity,
    )


async def fetch_engine_load(client: EngineClient, base_url: str, metrics: bool = True) -> EngineLoad:
    """Read ``/v1/loads`` and ``/metrics`` of the engine at ``base_url`` (concurrently) into one snapshot;
    ``metrics=False``: ``/v1/loads`` alone, every counter 0 (for the capacities, which every engine serves).

    Raises:
        EngineHTTPError: the engine cannot be reached, answered other than 200 (``/metrics`` is 404 unless the
            engine runs with ``--enable-metrics``) or not within the client's probe timeout.
        ValueError: a body is not what SGLang serves.
    """
    if metrics:
        loads_body, metrics_body = await asyncio.gather(client.get(base_url, "/v1/loads"), client.get(base_url, "/metrics"))
    else:
        loads_body, metrics_body = await client.get(base_url, "/v1/loads"), b""
    try:
        loads = orjson.loads(loads_body)
    except orjson.JSONDecodeError as err:
        raise ValueError(f"/v1/loads: not JSON: {err}") from None
    return engine_load(loads, parse_metrics(metrics_body.decode()))


async def read_capacity(client: EngineClient, engine: EngineState, prefix_index: PrefixCaches) -> None:
    """Put ``engine``'s KV pool and request slots (``/v1/loads``) on its state (``kv_capacity_tokens`` for ``policy:
    backlog``, ``max_running_requests`` for ``policy: laps``) and cap its prefix estimate at the pool. At start-up,
    and after the engine restarted with another role's flags or flipped, which may change both. Best effort: an
    engine that does not answer, or answers what SGLang does not serve, gets no slot count (laps counts no wait for
    a slot there) and keeps the KV pool it had (none at start-up: the byte budget alone caps its estimate), with a
    warning; nothing is raised, so a bad answer never keeps an engine out of routing."""
    try:
        load = await fetch_engine_load(client, engine.url, metrics=False)
    except Exception as err:  # best effort: see the docstring
        engine.max_running_requests = None
        log.warning("engine %s: no KV capacity or request slots from /v1/loads (%r); laps counts no wait for a request slot "
                    "there, and its prefix estimate keeps the cap it had", engine.id, err)
        return
    if load.max_total_tokens > 0:
        prefix_index.set_capacity(engine.id, load.max_total_tokens)
        engine.kv_capacity_tokens = load.max_total_tokens
    engine.max_running_requests = load.max_running_requests
    if load.max_running_requests is None:
        log.warning("engine %s: /v1/loads gives no max_running_requests; laps counts no wait for a request slot there", engine.id)
