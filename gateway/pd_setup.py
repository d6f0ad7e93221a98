"""What prefill–decode dispatch (:mod:`gateway.pd_dispatch`) keeps for the gateway's lifetime: the decode placement
and each prefill engine's KV bootstrap address, and the room id of one transfer.

The decode side of a request is one bookkeeping in three steps, here in one place for the one gateway process and
for the scheduler process of several workers (:mod:`gateway.sched_service`): :meth:`PDDispatch.take_decode` picks the
decode engine and counts the request there, :meth:`PDDispatch.decoding` records its first token at the client,
:meth:`PDDispatch.release_decode` ends it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlparse

from gateway.errors import APIError
from gateway.registry import EngineRegistry
from laps.config import Config
from policies.decode_placement import DecodePlacement
from policies.pool_signals import FirstTokenWindow
from policies.registry import make_decode_placement


def bootstrap_room() -> int:
    """A random KV-transfer room id in ``[0, 2**63)`` (SGLang's PD router draws it the same way)."""
    return random.getrandbits(63)


def no_decode_engine() -> APIError:
    """The client's error when no decode engine is healthy (HTTP 503)."""
    return APIError(503, "no healthy decode engine is available; retry later", type="service_unavailable", code="no_engine")


def bootstrap_addresses(config: Config, urls: dict[str, str]) -> dict[str, tuple[str, int]]:
    """``{engine id: (host, KV bootstrap port)}`` of ``config``'s engines at ``urls`` (``{name: base URL}``): the host
    is that of the engine's URL (``127.0.0.1`` for engines laps starts)."""
    return {e.name: (urlparse(urls[e.name]).hostname or "127.0.0.1", config.bootstrap_port(e)) for e in config.engines}


class DecodeSide(Protocol):
    """What :func:`gateway.pd_dispatch.relay` uses of :attr:`gateway.state.Gateway.pd`: :class:`PDDispatch` in one
    gateway process, :class:`gateway.sched_worker.RemoteDecodeSide` in a worker of several."""

    bootstrap: dict[str, tuple[str, int]]

    def take_decode(self, registry: EngineRegistry, rid: str, prompt_tokens: int, stream: bool, now: float) -> str | None: ...

    def decoding(self, first_tokens: FirstTokenWindow | None, rid: str, decode_id: str, now: float, late: bool) -> None: ...

    def release_decode(self, registry: EngineRegistry, rid: str, decode_id: str, prompt_tokens: int, now: float) -> None: ...


@dataclass
class PDDispatch:
    """What PD dispatch needs beyond the scheduler: the decode placement and each prefill engine's bootstrap address
    (``bootstrap``: :func:`bootstrap_addresses`)."""

    placement: DecodePlacement
    bootstrap: dict[str, tuple[str, int]] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: Config, urls: dict[str, str]) -> "PDDispatch":
        """The dispatch state of ``config`` (which has ``pd:``) with engines at ``urls`` (``{name: base URL}``)."""
        return cls(make_decode_placement(config.scheduling), bootstrap_addresses(config, urls))

    def take_decode(self, registry: EngineRegistry, rid: str, prompt_tokens: int, stream: bool, now: float) -> str | None:
        """The decode engine of request ``rid`` (``prompt_tokens`` long; ``stream``: its progress is reported), counted
        in flight there from ``now`` (monotonic seconds); ``None`` when no decode engine is healthy."""
        decode_id = self.placement.pick(rid, prompt_tokens, registry.decode_views(), now, reports_progress=stream)
        if decode_id is not None:
            registry.acquire(decode_id, prompt_tokens)
        return decode_id

    def decoding(self, first_tokens: FirstTokenWindow | None, rid: str, decode_id: str, now: float, late: bool) -> None:
        """The decode engine ``decode_id``'s first token of ``rid`` reached the client at ``now``; ``late``: after
        the request's deadline although its prefill was done by then (the controller's decode sizing counts it in
        ``first_tokens``, when it runs)."""
        self.placement.on_progress(rid, 1, now)
        if first_tokens is not None:
            first_tokens.record_late(decode_id, now, late)

    def release_decode(self, registry: EngineRegistry, rid: str, decode_id: str, prompt_tokens: int, now: float) -> None:
        """``rid`` (from :meth:`take_decode`) ended on ``decode_id`` at ``now``: answered, failed or cancelled."""
        registry.release(decode_id, prompt_tokens)
        self.placement.on_done(rid, now)
