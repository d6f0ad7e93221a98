"""Engine choice within a request class's pool: prefix-cache hit against load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from policies.types import EngineView, RequestClass, RequestView


@dataclass(frozen=True)
class PoolRouter:
    """Pick the healthy engine of the pool with the lowest ``in_flight - hit / tokens_per_request``.

    ``hit`` is the prefix-cache hit (tokens) the request(s) would get on that
    engine; ``tokens_per_request`` converts it into in-flight requests, so a
    256-token hit outweighs one extra request in flight by default. With no
    hits this is least-loaded routing. Ties go to fewer in-flight prompt
    tokens, then to the earlier engine in ``engines`` (deterministic). When the
    pool has no healthy engine, any healthy engine serves (a class is never
    refused for want of its pool). ``unified``: ignore pools, every engine
    serves every class. Returns ``None`` only when no engine is healthy.
    """

    tokens_per_request: float = 256.0
    unified: bool = False

    def pick(self, request: RequestView, engines: Sequence[EngineView], now: float) -> str | None:
        """The :class:`~policies.scheduler.Picker` interface: :meth:`select` for ``request``."""
        return self.select(engines, request.request_class, request.cached_by_engine)

    def select(self, engines: Sequence[EngineView], request_class: RequestClass, hits: Mapping[str, int] | None = None) -> str | None:
        healthy = [e for e in engines if e.healthy]
        candidates = healthy if self.unified else [e for e in healthy if e.pool == request_class] or healthy
        if not candidates:
            return None
        hits = hits or {}

        def key(i: int) -> tuple[float, int, int]:
            e = candidates[i]
            return (e.in_flight - hits.get(e.id, 0) / self.tokens_per_request, e.in_flight_prompt_tokens, i)

        return candidates[min(range(len(candidates)), key=key)].id
