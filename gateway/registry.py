"""The engine registry: the one owner of the fleet's health and gateway-side load.

Policies never see this object, only the immutable :class:`EngineView`
snapshots it hands out.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.types import EngineView, Pool


@dataclass
class EngineState:
    """Mutable gateway-side state of one engine.

    ``healthy`` follows the engine's ``/ready``; ``draining`` is set while the
    engine is being emptied for a restart; ``stalled`` while it answers
    ``/ready`` but its streams have stopped (see :mod:`gateway.health`).
    Policies see an engine as healthy only when it is :attr:`serving`, so no new
    work goes to it otherwise. ``kv_capacity_tokens`` is the engine's KV pool
    and ``max_running_requests`` its request slots, as it reported them at
    start-up or after its last restart or flip (``None``: not reported).
    ``open_streams``: streams relayed from it that have had their first byte
    and not ended; ``last_byte_s``: when the engine last sent bytes, a stream's
    chunk or a whole answer (the event loop's ``loop.time()``, seconds; 0: never);
    ``timed_out_s``: when a request on it last timed out without that taking
    it out of service (a first-byte or stall timeout while it still sent
    bytes, or an answer past ``gateway.request_timeout_s``: its generation
    probe decides, :func:`gateway.health.engine_failed`).
    """

    id: str
    url: str
    pool: Pool
    healthy: bool = True
    draining: bool = False
    in_flight: int = 0
    in_flight_prompt_tokens: int = 0
    kv_capacity_tokens: int | None = None
    max_running_requests: int | None = None
    stalled: bool = False
    open_streams: int = 0
    last_byte_s: float = 0.0
    timed_out_s: float = 0.0

    @property
    def serving(self) -> bool:
        """Whether new work may go to the engine: healthy, not draining, not stalled."""
        return self.healthy and not self.draining and not self.stalled

    def view(self) -> EngineView:
        return EngineView(self.id, self.pool, self.serving, self.in_flight, self.in_flight_prompt_tokens, self.kv_capacity_tokens,
                          self.max_running_requests)


class EngineRegistry:
    """All engines by id, in configuration order."""

    def __init__(self, engines: list[EngineState]) -> None:
        self._engines = {e.id: e for e in engines}

    def __iter__(self):
        return iter(self._engines.values())

    def __getitem__(self, engine_id: str) -> EngineState:
        return self._engines[engine_id]

    def views(self) -> list[EngineView]:
        """The prefill engines (pools ``short`` and ``long``), as the scheduler and the controller see them."""
        return [e.view() for e in self._engines.values() if e.pool != "decode"]

    def prefill_ids(self) -> list[str]:
        """The ids of the prefill engines (pools ``short`` and ``long``) now."""
        return [e.id for e in self._engines.values() if e.pool != "decode"]

    def decode_views(self) -> list[EngineView]:
        """The decode engines of a PD deployment (pool ``decode``), for the decode placement."""
        return [e.view() for e in self._engines.values() if e.pool == "decode"]

    def acquire(self, engine_id: str, prompt_tokens: int) -> None:
        """Count a request as in flight on ``engine_id`` until :meth:`release`."""
        e = self._engines[engine_id]
        e.in_flight += 1
        e.in_flight_prompt_tokens += prompt_tokens

    def release(self, engine_id: str, prompt_tokens: int) -> None:
        e = self._engines[engine_id]
        e.in_flight -= 1
        e.in_flight_prompt_tokens -= prompt_tokens
