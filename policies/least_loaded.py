"""Least-loaded engine selection within a request class's pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from policies.types import EngineView, RequestClass


@dataclass(frozen=True)
class LeastLoadedRouter:
    """Pick the healthy engine of the request's pool with the fewest in-flight requests.

    Ties go to fewer in-flight prompt tokens, then to the earlier engine in
    ``engines`` (deterministic). When the pool has no healthy engine, any
    healthy engine serves (a class is never refused for want of its pool).
    Returns ``None`` only when no engine is healthy.
    """

    def select(self, engines: Sequence[EngineView], request_class: RequestClass) -> str | None:
        healthy = [e for e in engines if e.healthy]
        candidates = [e for e in healthy if e.pool == request_class] or healthy
        if not candidates:
            return None
        best = min(range(len(candidates)), key=lambda i: (candidates[i].in_flight, candidates[i].in_flight_prompt_tokens, i))
        return candidates[best].id
