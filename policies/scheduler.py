"""The scheduler contract, and the simplest scheduler: dispatch at once to the least-loaded engine.

A runner (the live gateway, or the virtual-time simulator) drives a scheduler:

1. ``submit(request, now)`` when a classified request arrives;
2. ``decide(engines, now)`` after every event and at the last ``wake_at_s``;
   the runner carries out the returned :class:`Decision`;
3. ``cancel(rid, now)`` when a request not yet dispatched goes away;
4. ``on_first_token`` / ``on_complete`` as dispatched requests progress.

Schedulers are pure: no I/O, no asyncio, no clock but ``now``.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from policies.pool_router import PoolRouter
from policies.types import Decision, Dispatch, EngineView, RequestView


class Scheduler(Protocol):
    """What every scheduling policy implements (see the module docstring for the call order)."""

    def submit(self, request: RequestView, now: float) -> None: ...

    def cancel(self, rid: str, now: float) -> None: ...

    def decide(self, engines: Sequence[EngineView], now: float) -> Decision: ...

    def on_first_token(self, rid: str, engine_id: str, now: float, reported_cached_tokens: int | None) -> None: ...

    def on_complete(self, rid: str, engine_id: str, now: float) -> None: ...

    def stats(self) -> dict[str, float]:
        """The policy's current state for metrics (``{name: value}``; exported as ``laps_scheduler_<name>``,
        a counter when the name ends in ``_total``)."""
        ...


class Picker(Protocol):
    """Chooses one engine for one request (the routers of SGLang's router and similar gateways)."""

    def pick(self, request: RequestView, engines: Sequence[EngineView], now: float) -> str | None:
        """The engine id for ``request``, or ``None`` when no engine can take it."""


class ImmediateScheduler:
    """Dispatch every request the moment it arrives to the engine its ``picker`` chooses.

    No batching window: the shape of every router baseline (round robin,
    least load, cache aware, bucket), and with the default :class:`PoolRouter`
    the plain length-aware split. Requests are rejected only when the picker
    finds no engine (none healthy). Requests pending together go in priority order
    (:attr:`~policies.types.RequestView.priority_rank`), in arrival order within a priority.
    """

    NAME = "immediate"

    def __init__(self, picker: Picker | None = None) -> None:
        self.picker = picker or PoolRouter()
        self._pending: dict[str, RequestView] = {}

    def submit(self, request: RequestView, now: float) -> None:
        self._pending[request.rid] = request

    def cancel(self, rid: str, now: float) -> None:
        self._pending.pop(rid, None)

    def decide(self, engines: Sequence[EngineView], now: float) -> Decision:
        dispatches, rejected = [], []
        load = {e.id: e for e in engines}
        for request in sorted(self._pending.values(), key=lambda r: r.priority_rank):  # stable: arrival order within a priority
            rid = request.rid
            engine_id = self.picker.pick(request, list(load.values()), now)
            if engine_id is None:
                rejected.append(rid)
                continue
            dispatches.append(Dispatch(engine_id, (rid,)))
            # Count this dispatch so the next request in the same decision sees it.
            load[engine_id] = load[engine_id].with_dispatched(1, request.prompt_tokens)
        self._pending.clear()
        return Decision(tuple(dispatches), tuple(rejected))

    def on_first_token(self, rid: str, engine_id: str, now: float, reported_cached_tokens: int | None) -> None:
        """Nothing to learn: the immediate scheduler keeps no state about dispatched requests."""

    def on_complete(self, rid: str, engine_id: str, now: float) -> None:
        """Nothing to learn: the immediate scheduler keeps no state about dispatched requests."""

    def stats(self) -> dict[str, float]:
        return {"queued_requests": len(self._pending)}
