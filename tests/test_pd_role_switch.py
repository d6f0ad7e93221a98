"""Moves between the prefill and decode sides with ``pd.role_switch``: flipped in place by SGLang's ``POST /pd_role_switch``, not restarted.

Scripted on simulated engines: :func:`gateway.role_switch.switch_role` against
engines served in this process (a stand-in manager records restarts), then the
admin API of a live gateway whose engines laps launched with ``--enable-pd-role-switch``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from dataclasses import replace
from types import SimpleNamespace

import aiohttp
import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from engines.client import EngineClient
from engines.manager import configured_ports, engine_command, free_port
from engines.sim.args import parse_server_args
from engines.sim.realtime import ENGINE
from engines.sim.server import create_app
from gateway.registry import EngineRegistry, EngineState
from gateway.role_switch import check_side, switch_role
from laps.config import ConfigError, parse_config
from tests.live_gateway import LiveGateway
from tests.pd_stack import free_bootstrap_base, pd_config, pd_data
from tests.test_role_switch import ForgettingIndex, RecordingManager
from tests.test_sim_pd import body, sim_args

SAME_FLAGS = {"max-running-requests": 256}
ROLES = {
    "prefill-short": {"pool": "short", "flags": {"chunked-prefill-size": 2048}},
    "prefill-long": {"pool": "long", "flags": SAME_FLAGS},
    "decode": {"pool": "decode", "flags": SAME_FLAGS},
}


def flip_data(**top) -> dict:
    """:func:`tests.pd_stack.pd_data` with ``pd.role_switch`` on, the controller off and :data:`ROLES` (prefill-long and decode share flags)."""
    pd = {"transfer_backend": "mooncake", "bootstrap_port": 8998, "role_switch": True, "decode_cuda_graph_memory_gb": 1.5}
    data = pd_data(**{"pd": pd, "controller": {"enabled": False}, **top})
    data["roles"].update(copy.deepcopy(ROLES))
    return data


def flip_config(**top):
    return parse_config(flip_data(**top))


@contextlib.asynccontextmanager
async def stand_in_gateway(config, apps: dict[str, web.Application]):
    """A gateway-shaped namespace over engines served here: registry at their URLs, a recording manager, a real engine client."""
    servers = {name: TestServer(app, handler_cancellation=True) for name, app in apps.items()}
    for s in servers.values():
        await s.start_server()
    registry = EngineRegistry([EngineState(e.name, str(servers[e.name].make_url("")).rstrip("/") if e.name in servers else "http://127.0.0.1:9",
                                           config.pool(e)) for e in config.engines])
    client = EngineClient()
    await client.start()
    try:
        yield SimpleNamespace(config=config, registry=registry, manager=RecordingManager({e.name: e.role for e in config.engines}),
                              client=client, prefix_index=ForgettingIndex()), servers
    finally:
        await client.close()
        for s in servers.values():
            await s.close()


def capable(mode: str) -> object:
    return replace(sim_args(mode, free_port()), enable_pd_role_switch=True)


async def test_a_prefill_engine_flips_to_decode_and_back_with_no_restart(caplog):
    config = flip_config()
    async with stand_in_gateway(config, {"pl0": create_app(capable("prefill"))}) as (gw, servers):
        engine = servers["pl0"].app[ENGINE]
        with caplog.at_level(logging.INFO, logger="laps.gateway"):
            await switch_role(gw, "pl0", "decode", drain_timeout_s=5.0)
        state = gw.registry["pl0"]
        assert (state.pool, state.draining, state.healthy) == ("decode", False, True)
        assert gw.manager.restarts == [] and gw.prefix_index.forgotten == ["pl0"] and gw.manager.engines["pl0"].role == "decode"
        assert engine.core.config.disaggregation_mode == "decode"
        assert "engine pl0: flipped from prefill to decode in place (POST /pd_role_switch: ok)" in caplog.messages
        await switch_role(gw, "pl0", "prefill-long", drain_timeout_s=5.0)
        assert (state.pool, engine.core.config.disaggregation_mode, gw.manager.restarts) == ("long", "prefill", [])


async def test_a_move_across_sides_with_other_flags_restarts_and_without_role_switch_is_refused():
    config = flip_config()
    async with stand_in_gateway(config, {}) as (gw, _):
        await switch_role(gw, "ps0", "decode", drain_timeout_s=1.0)  # prefill-short's flags differ from decode's
        assert gw.manager.restarts == [("ps0", "decode")] and gw.registry["ps0"].pool == "decode"
    async with stand_in_gateway(pd_config(controller={"enabled": False}), {}) as (gw, _):
        with pytest.raises(ValueError, match=r"the decode pool is sized in the config \(set pd.role_switch to flip engines between prefill and decode\)"):
            check_side(gw, "pl0", "decode")


async def test_an_engine_still_busy_at_the_drain_deadline_keeps_its_role_and_its_requests():
    config = flip_config()
    async with stand_in_gateway(config, {"pl0": create_app(capable("prefill"))}) as (gw, servers):
        engine = servers["pl0"].app[ENGINE]
        # A prefill whose decode side never fetches its KV: the engine holds it, busy, until the request is aborted.
        request = body(5, engine.sim.args.disaggregation_bootstrap_port)
        session = aiohttp.ClientSession()  # the client of a request that outlives the drain
        running = asyncio.ensure_future(session.post(str(servers["pl0"].make_url("/v1/chat/completions")), json=request))
        while engine.core.fully_idle():
            await asyncio.sleep(0.001)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="engine pl0 refused the flip to decode: instance is not idle; drain all requests before switching; it serves as before"):
            await switch_role(gw, "pl0", "decode", drain_timeout_s=0.3)
        assert time.monotonic() - started >= 0.3  # it asked again until the deadline
        state = gw.registry["pl0"]
        assert (state.pool, state.draining, gw.manager.restarts, gw.manager.engines["pl0"].role) == ("long", False, [], "prefill-long")
        assert not engine.core.fully_idle()  # the request goes on
        async with session.post(str(servers["pl0"].make_url("/abort_request")), json={"rid": "r1"}) as resp:
            assert resp.status == 200
        (await running).close()
        await session.close()


async def test_an_engine_left_unhealthy_by_a_failed_flip_is_restarted():
    async def broken(request: web.Request) -> web.Response:
        return web.json_response({"rid": None, "http_worker_ipc": None, "success": False, "old_role": "prefill", "new_role": "decode",
                                  "message": "role switch failed; instance unhealthy, restart required: boom", "safe_to_restore": False}, status=400)
    app = web.Application()
    app.router.add_post("/pd_role_switch", broken)
    async with stand_in_gateway(flip_config(), {"pl0": app}) as (gw, _):
        await switch_role(gw, "pl0", "decode", drain_timeout_s=1.0)
        assert gw.manager.restarts == [("pl0", "decode")] and gw.registry["pl0"].pool == "decode"


def test_role_switch_puts_the_flag_and_a_bootstrap_port_on_every_engine_and_refuses_nixl():
    config = flip_config()
    for engine in config.engines:
        parsed = parse_server_args(engine_command(config, engine, 30000)[3:])
        assert parsed.enable_pd_role_switch and parsed.disaggregation_bootstrap_port == config.bootstrap_port(engine)
    assert [config.bootstrap_port(e) for e in config.engines] == [8998, 8999, 9000, 9001]
    # the manager hands out no engine or KV-event port that an engine's bootstrap server binds, decode engines' included
    assert {8998, 8999, 9000, 9001} <= configured_ports(config)
    assert {8998, 8999} <= configured_ports(pd_config()) and not {9000, 9001} & configured_ports(pd_config())
    with pytest.raises(ConfigError, match="nixl transfer backend does not support a runtime role switch"):
        pd_config(pd={"transfer_backend": "nixl", "role_switch": True})
    assert not any(parse_server_args(engine_command(pd_config(), e, 30000)[3:]).enable_pd_role_switch for e in pd_config().engines)


KEY = "s3cret-admin-key"


def test_the_admin_api_flips_a_decode_engine_to_prefill_in_place(tmp_path):
    data = flip_data(log_dir=str(tmp_path / "logs"))
    data["pd"]["bootstrap_port"] = free_bootstrap_base()
    data["gateway"].update(port=free_port(), admin_key=KEY)
    with LiveGateway(parse_config(data)) as live:
        headers = {"Authorization": f"Bearer {KEY}"}
        d1 = live.gateway.registry["d1"]
        started = httpx.get(f"{d1.url}/server_info", timeout=10).json()["startup_time"]
        resp = httpx.post(live.url + "/admin/engines/d1/role", headers=headers, json={"role": "prefill-long", "drain_timeout_s": 5}, timeout=10)
        assert resp.status_code == 202 and resp.json() == {"engine": "d1", "role": "prefill-long", "status": "switching"}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            row = next(e for e in httpx.get(live.url + "/admin/engines", headers=headers, timeout=10).json()["engines"] if e["id"] == "d1")
            if row["state"] != "switching":
                break
            time.sleep(0.1)
        assert (row["role"], row["pool"], row["state"]) == ("prefill-long", "long", "healthy")
        info = httpx.get(f"{d1.url}/server_info", timeout=10).json()
        assert (info["disaggregation_mode"], info["startup_time"]) == ("prefill", started)  # the same process, flipped
        payload = {"model": live.config.model.name, "messages": [{"role": "user", "content": " word" * 400}], "max_tokens": 4, "stream": True}
        resp = httpx.post(live.url + "/v1/chat/completions", json=payload, timeout=30)
        assert resp.status_code == 200 and resp.headers["x-laps-decode-engine"] == "d0" and resp.text.endswith("data: [DONE]\n\n")
