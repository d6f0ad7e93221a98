"""gateway.role_switch.switch_role against a stand-in manager: what it logs and what it leaves on the engine's state."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest

from engines.client import EngineHTTPError
from gateway.registry import EngineRegistry, EngineState
from gateway.role_switch import switch_role
from laps.config import load_config


class RecordingManager:
    """Restarts nothing; records the restarts asked for."""

    def __init__(self, roles: dict[str, str]) -> None:
        self.engines = {name: SimpleNamespace(role=role) for name, role in roles.items()}  # the role each runs now
        self.restarts: list[tuple[str, str]] = []

    async def restart(self, engine_id: str, role: str, client: object) -> None:
        self.restarts.append((engine_id, role))


class ForgettingIndex:
    def __init__(self) -> None:
        self.forgotten: list[str] = []
        self.capacities: dict[str, int] = {}

    def forget_engine(self, engine_id: str) -> None:
        self.forgotten.append(engine_id)

    def set_capacity(self, engine_id: str, kv_tokens: int) -> None:
        self.capacities[engine_id] = kv_tokens


class LoadsClient:
    """Answers ``GET /v1/loads`` with one rank of ``slots`` request slots and a 500,000-token KV pool (the engine as
    restarted); ``slots=None``: the engine cannot be reached."""

    def __init__(self, slots: int | None) -> None:
        self.slots = slots

    async def get(self, url: str, path: str) -> bytes:
        assert path == "/v1/loads"
        if self.slots is None:
            raise EngineHTTPError(f"GET {url}{path}: connection refused")
        rank = {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_waiting_uncached_tokens": 0, "num_used_tokens": 0,
                "max_total_num_tokens": 500_000, "cache_hit_rate": 0.0, "max_running_requests": self.slots}
        return orjson.dumps({"loads": [rank]})


def stand_in_gateway(healthy: bool, config=None, slots: int | None = 64) -> SimpleNamespace:
    config = config or load_config()
    registry = EngineRegistry([EngineState(e.name, f"http://engine-{e.name}", config.pool(e), healthy=healthy, kv_capacity_tokens=900_000,
                                           max_running_requests=256) for e in config.engines])
    return SimpleNamespace(config=config, registry=registry, manager=RecordingManager({e.name: e.role for e in config.engines}),
                           client=LoadsClient(slots), prefix_index=ForgettingIndex())


@pytest.mark.parametrize("healthy_before, recovery_logged", [(False, True), (True, False)])
def test_a_switch_logs_the_engine_healthy_again_when_the_poller_had_seen_it_down(caplog, healthy_before, recovery_logged):
    gw = stand_in_gateway(healthy_before)
    with caplog.at_level(logging.INFO, logger="laps.gateway"):
        asyncio.run(switch_role(gw, "lp0", "short-prefill", drain_timeout_s=1.0))
    state = gw.registry["lp0"]
    assert (state.pool, state.healthy, state.draining) == ("short", True, False)
    assert gw.manager.restarts == [("lp0", "short-prefill")] and gw.prefix_index.forgotten == ["lp0"]
    assert [r.levelno for r in caplog.records if r.getMessage() == "engine lp0 is now healthy"] == ([logging.INFO] if recovery_logged else [])


def test_a_switch_to_a_role_with_the_same_flags_is_instant_and_keeps_the_cache(caplog):
    gw = stand_in_gateway(True, load_config(Path(__file__).resolve().parent.parent / "examples" / "sim-h200x8.yaml"))
    gw.registry["e0"].in_flight = 3  # running requests stay: nothing drains
    with caplog.at_level(logging.INFO, logger="laps.gateway"):
        asyncio.run(switch_role(gw, "e0", "long-prefill", drain_timeout_s=1.0))
    state = gw.registry["e0"]
    assert (state.pool, state.draining, state.in_flight) == ("long", False, 3)
    assert gw.manager.restarts == [] and gw.prefix_index.forgotten == [] and gw.manager.engines["e0"].role == "long-prefill"
    assert (gw.prefix_index.capacities, state.max_running_requests) == ({}, 256)  # nothing read again
    assert "engine e0: serving as long-prefill in the long pool (same engine flags and plugin: no drain, no restart)" in caplog.messages


def test_a_restart_reads_the_engines_kv_pool_and_request_slots_again(caplog):
    # lp0's state says 256 slots and a 900,000-token pool; restarted, its /v1/loads says 64 and 500,000: the
    # scheduler's view follows the engine.
    gw = stand_in_gateway(True, slots=64)
    asyncio.run(switch_role(gw, "lp0", "short-prefill", drain_timeout_s=1.0))
    view = next(v for v in gw.registry.views() if v.id == "lp0")
    assert (view.kv_capacity_tokens, view.max_running_requests) == (500_000, 64)
    assert gw.prefix_index.capacities == {"lp0": 500_000}
    # An engine that cannot be reached after its restart is routed to again with no slot count (no slot wait
    # counted, rather than the old role's) and the KV pool it had, with a warning.
    gw = stand_in_gateway(True, slots=None)
    with caplog.at_level(logging.WARNING, logger="laps.gateway"):
        asyncio.run(switch_role(gw, "lp0", "short-prefill", drain_timeout_s=1.0))
    state = gw.registry["lp0"]
    assert (state.kv_capacity_tokens, state.max_running_requests, state.draining, state.pool) == (900_000, None, False, "short")
    assert any(m.startswith("engine lp0: no KV capacity or request slots from /v1/loads") for m in caplog.messages)
