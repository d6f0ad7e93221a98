"""Immutable views and decisions exchanged between the runner (gateway or simulator) and policies."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Mapping

RequestClass = Literal["short", "long"]
Pool = Literal["short", "long", "decode"]
"""An engine's pool: a request class it prefills, or ``decode`` (the decode side of a PD deployment)."""


@dataclass(frozen=True, slots=True)
class RequestView:
    """One request as a policy sees it.

    ``prompt_tokens``: templated prompt length; ``cached_tokens``: H, the most
    leading tokens any engine probably holds in its prefix cache (per engine in
    ``cached_by_engine``); the new tokens to prefill are ``L = prompt_tokens -
    cached_tokens``. ``in_flight_by_engine``: per engine (absent: 0), the
    leading tokens of the prompt that a prefill in flight there is computing
    now, so that engine will hold them once that prefill is done (not counted
    in ``cached_tokens``: :mod:`policies.in_flight_prefix`). ``request_class`` is
    set by the classifier before the request reaches a scheduler. Times are seconds on the caller's clock.
    ``max_tokens``: the client's output cap (``None``: none sent); ``reply_tokens``:
    token counts of the conversation's earlier assistant replies, oldest first
    (filled only for policies that predict output lengths, else empty).
    ``stream``: the client streams, so its first token is reported when it is
    generated; ``False``: only when the whole answer is in.
    ``length_deadline_s``: the length-aware deadline (``slo.ttft_per_1k_new_tokens_s``; ``None`` when that is
    unset or the client set its own deadline), which a scheduler may use in place of ``deadline_s`` for a request
    that cannot meet ``deadline_s`` even alone on an idle engine (:class:`policies.laps.LapsScheduler` does).
    ``priority``: how urgent the request is, higher values first (the gateway
    gives SGLang's ``priority`` here, negated for engines that schedule low
    values first); ``None`` after every request that has one, as SGLang
    ranks requests without one. Schedulers order their queues of a class by
    :attr:`priority_rank`, keeping their own order among equal priorities.
    """

    rid: str
    prompt_tokens: int
    cached_tokens: int = 0
    arrival_s: float = 0.0
    deadline_s: float = math.inf
    request_class: RequestClass = "short"
    cached_by_engine: Mapping[str, int] = field(default_factory=dict)
    in_flight_by_engine: Mapping[str, int] = field(default_factory=dict)
    max_tokens: int | None = None
    reply_tokens: tuple[int, ...] = ()
    stream: bool = True
    priority: int | None = None
    length_deadline_s: float | None = None

    @property
    def new_tokens(self) -> int:
        """L, the uncached prompt tokens this request's prefill must compute."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def priority_rank(self) -> tuple[int, int]:
        """Sort key of :attr:`priority`, smallest first: higher priorities, then requests without one."""
        return (1, 0) if self.priority is None else (0, -self.priority)


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine as a policy sees it: identity, pool, health and gateway-side load.

    Schedulers and the pool controller see only prefill engines (pool ``short``
    or ``long``); decode engines (pool ``decode``) go to a decode placement.
    ``kv_capacity_tokens``: the engine's KV pool (``max_total_tokens`` from
    ``/v1/loads``), ``None`` until the engine has said; ``max_running_requests``:
    its request slots (``/v1/loads`` too), ``None`` until it has said. A
    request beyond them waits in the engine until a running one finishes.
    """

    id: str
    pool: Pool
    healthy: bool = True
    in_flight: int = 0
    in_flight_prompt_tokens: int = 0
    kv_capacity_tokens: int | None = None
    max_running_requests: int | None = None

    def with_dispatched(self, requests: int, prompt_tokens: int) -> "EngineView":
        """This view after ``requests`` more requests (``prompt_tokens`` in all) were sent to it."""
        return EngineView(self.id, self.pool, self.healthy, self.in_flight + requests, self.in_flight_prompt_tokens + prompt_tokens,
                          self.kv_capacity_tokens, self.max_running_requests)


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Send ``rids`` to ``engine_id`` now, as one group (an AWD batch has several)."""

    engine_id: str
    rids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Decision:
    """What a scheduler wants done at ``now``.

    ``dispatches``: groups to send now; ``rejected``: requests that cannot be
    served (no healthy engine) and must fail; ``wake_at_s``: call ``decide``
    again at this time even if nothing else happens (``None``: no timer).
    """

    dispatches: tuple[Dispatch, ...] = ()
    rejected: tuple[str, ...] = ()
    wake_at_s: float | None = None
