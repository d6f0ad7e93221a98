"""What prefill–decode dispatch (:mod:`gateway.pd_dispatch`) keeps for the gateway's lifetime: the decode placement
and each prefill engine's KV bootstrap address, and the room id of one transfer."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from urllib.parse import urlparse

from laps.config import Config
from policies.decode_placement import DecodePlacement
from policies.registry import make_decode_placement


def bootstrap_room() -> int:
    """A random KV-transfer room id in ``[0, 2**63)`` (SGLang's PD router draws it the same way)."""
    return random.getrandbits(63)


@dataclass
class PDDispatch:
    """What PD dispatch needs beyond the scheduler: the decode placement and each prefill engine's bootstrap address.

    ``bootstrap``: ``{prefill engine id: (host, port)}``; the host is that of
    the engine's URL (``127.0.0.1`` for engines laps starts).
    """

    placement: DecodePlacement
    bootstrap: dict[str, tuple[str, int]] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: Config, urls: dict[str, str]) -> "PDDispatch":
        """The dispatch state of ``config`` (which has ``pd:``) with engines at ``urls`` (``{name: base URL}``)."""
        bootstrap = {e.name: (urlparse(urls[e.name]).hostname or "127.0.0.1", config.bootstrap_port(e)) for e in config.engines}
        return cls(make_decode_placement(config.scheduling), bootstrap)
