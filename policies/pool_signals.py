"""The pressure controller's inputs, built one way for the live gateway and the virtual-time simulator.

Both runners hand :func:`engine_signals` the same things: the engines as
policies see them (:class:`~policies.types.EngineView`), the requests the
gateway holds undispatched (:func:`queued_new_tokens`), each engine's own load
(:class:`LoadSample`: from ``GET /v1/loads`` live, from the engine model's
``stats()`` in virtual time, the fields the simulated engine's ``/v1/loads``
serves) and the first tokens of the recent past (:class:`FirstTokenWindow`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from policies.controller import POOLS, EngineSignals
from policies.types import EngineView, RequestClass, RequestView


@dataclass(frozen=True, slots=True)
class LoadSample:
    """An engine's ``/v1/loads`` fields the controller reads: ``num_waiting_uncached_tokens``,
    ``num_running_reqs`` and ``token_usage`` (KV tokens in use / KV pool, in [0, 1]); for a PD decode engine
    also ``num_waiting_reqs`` and ``max_running_requests`` (``None`` where the engine does not say)."""

    waiting_uncached_tokens: int
    running_requests: int
    token_usage: float
    waiting_requests: int = 0
    max_running_requests: int | None = None


class FirstTokenWindow:
    """Per engine, whether each first token of the last ``window_s`` seconds came after its TTFT deadline.

    ``min_first_tokens``: an engine's violation share is its late first tokens over at least this many, so a
    few first tokens cannot make a pressure on their own (one cold-start TTFT on an idle node is a share of
    1/10 with 10, not 1); where the window holds that many or more, it is the plain share.

    Memory: one entry per first token within the window (pruned on every
    :meth:`record` and :meth:`violation_share` of that engine).

    Raises:
        ValueError: ``window_s`` <= 0 or ``min_first_tokens`` < 1.
    """

    def __init__(self, window_s: float, min_first_tokens: int = 1) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if min_first_tokens < 1:
            raise ValueError(f"min_first_tokens must be >= 1, got {min_first_tokens}")
        self.window_s = window_s
        self.min_first_tokens = min_first_tokens
        self._events: dict[str, deque[tuple[float, bool]]] = {}

    def record(self, engine_id: str, now: float, deadline_s: float) -> None:
        """``engine_id`` gave a request its first token at ``now``; the request's TTFT deadline was ``deadline_s``."""
        self.record_late(engine_id, now, now > deadline_s)

    def record_late(self, engine_id: str, now: float, late: bool) -> None:
        """``engine_id`` gave a request its first token at ``now``, late (counted as a violation) or not."""
        events = self._events.setdefault(engine_id, deque())
        events.append((now, late))
        self._prune(events, now)

    def violation_share(self, engine_id: str, now: float) -> float:
        """Late first tokens of ``engine_id`` in ``(now - window_s, now]`` over their count or ``min_first_tokens``,
        whichever is more; 0 when there were none."""
        events = self._events.get(engine_id)
        if not events:
            return 0.0
        self._prune(events, now)
        return sum(late for _, late in events) / max(len(events), self.min_first_tokens)

    def forget_engine(self, engine_id: str) -> None:
        """Drop ``engine_id``'s history (it restarted in another role)."""
        self._events.pop(engine_id, None)

    def _prune(self, events: deque[tuple[float, bool]], now: float) -> None:
        while events and events[0][0] <= now - self.window_s:
            events.popleft()


def queued_new_tokens(queued: Iterable[RequestView]) -> dict[RequestClass, int]:
    """New (uncached) prompt tokens of the requests the gateway holds undispatched, per pool (= request class)."""
    totals: dict[RequestClass, int] = {pool: 0 for pool in POOLS}
    for request in queued:
        if request.request_class in totals:
            totals[request.request_class] += request.new_tokens
    return totals


def engine_signals(engines: Sequence[EngineView], queued_tokens: Mapping[RequestClass, float], loads: Mapping[str, LoadSample],
                   first_tokens: FirstTokenWindow, now: float, fixed: Collection[str] = (),
                   decode: Sequence[EngineView] = ()) -> list[EngineSignals]:
    """One :class:`~policies.controller.EngineSignals` per engine that serves the short or long pool now, then one
    per engine of ``decode`` (PD decode engines, for :class:`~policies.pd_controller.PDPressureController`) that serves.

    Serving: healthy in the policies' sense (healthy and not draining or
    switching) and with a load sample in ``loads``; engines of any other pool
    are left out. A pool's ``queued_tokens`` is split evenly among its
    serving engines. Engines in ``fixed`` (``external``) are not movable.
    """
    serving = [e for e in engines if e.healthy and e.pool in POOLS and e.id in loads]
    sizes = {pool: sum(e.pool == pool for e in serving) for pool in POOLS}
    prefill = [
        EngineSignals(
            e.id, e.pool,
            gateway_queued_tokens=queued_tokens.get(e.pool, 0) / sizes[e.pool],
            engine_waiting_tokens=loads[e.id].waiting_uncached_tokens,
            ttft_slo_violation_share=first_tokens.violation_share(e.id, now),
            running_requests=loads[e.id].running_requests,
            kv_token_usage=min(1.0, max(0.0, loads[e.id].token_usage)),
            movable=e.id not in fixed,
        )
        for e in serving
    ]
    return prefill + [
        EngineSignals(
            e.id, "decode",
            ttft_slo_violation_share=first_tokens.violation_share(e.id, now),
            running_requests=loads[e.id].running_requests,
            kv_token_usage=min(1.0, max(0.0, loads[e.id].token_usage)),
            waiting_requests=loads[e.id].waiting_requests,
            max_running_requests=loads[e.id].max_running_requests,
            movable=e.id not in fixed,
        )
        for e in decode if e.healthy and e.pool == "decode" and e.id in loads
    ]
