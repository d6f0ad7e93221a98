"""Immutable views that policies read; the gateway (or the simulator) builds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RequestClass = Literal["short", "long"]


@dataclass(frozen=True, slots=True)
class RequestView:
    """One request as a policy sees it.

    ``prompt_tokens``: templated prompt length; ``cached_tokens``: leading
    tokens estimated to be in the target engine's prefix cache (H); the new
    tokens to prefill are ``L = prompt_tokens - cached_tokens``. Times are
    seconds on the caller's clock.
    """

    rid: str
    prompt_tokens: int
    cached_tokens: int = 0
    arrival_s: float = 0.0

    @property
    def new_tokens(self) -> int:
        """L, the uncached prompt tokens this request's prefill must compute."""
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine as a policy sees it: identity, pool, health and gateway-side load."""

    id: str
    pool: RequestClass
    healthy: bool = True
    in_flight: int = 0
    in_flight_prompt_tokens: int = 0
