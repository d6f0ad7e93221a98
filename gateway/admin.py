"""The admin API: list engines and move one to another role by hand.

``GET /admin/engines`` and ``POST /admin/engines/{id}/role`` (body
``{"role": NAME, "drain_timeout_s": S}``) need ``Authorization: Bearer
<gateway.admin_key>``; without a configured key the admin API is off (403).
A move to a role with the same flags (and plugin) is instant (``"status": "moving"``);
any other drains the engine, then flips it between prefill and decode in place
(``pd.role_switch``: SGLang's ``POST /pd_role_switch``) or restarts it (minutes
for real SGLang), so the POST answers 202 at once (``"status": "switching"``)
and ``GET /admin/engines`` shows ``switching`` until it is done. To the role the
engine has already, it answers 200 ``"unchanged"`` and does nothing.

With ``gateway.workers`` > 1 the engines, and so their roles and switches, are
the scheduler process's: a worker checks the key and the body, then asks the
scheduler (:mod:`gateway.sched_service`'s ``admin_engines`` and ``admin_role``),
which answers from :func:`engine_rows` and :func:`begin_switch` as one process does.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
from aiohttp import web

from gateway.auth import admin_key_given
from gateway.errors import APIError, expect_continue
from gateway.handlers import read_body
from gateway.priority import engine_role
from gateway.role_switch import check_side, switch_role
from gateway.state import GATEWAY, Gateway

log = logging.getLogger("laps.gateway")

SWITCHES = web.AppKey("role_switches", dict)
"""Role switches in progress: ``{engine id: asyncio.Task}``."""


def _authorize(request: web.Request) -> Gateway:
    gw = request.app[GATEWAY]
    if gw.config.gateway.admin_key is None:
        raise APIError(403, "the admin API is off: set gateway.admin_key in the config", type="permission_error")
    if not admin_key_given(request, gw):
        err = APIError(401, "missing or wrong admin key (Authorization: Bearer <gateway.admin_key>)", type="authentication_error")
        err.headers["WWW-Authenticate"] = "Bearer"
        raise err
    return gw


async def list_engines(request: web.Request) -> web.Response:
    """``GET /admin/engines``: every engine's kind, role, pool, state, GPUs, URL and gateway-side load."""
    gw = _authorize(request)
    rows = (await _ask_scheduler(gw, {"op": "admin_engines"}))["engines"] if gw.admin is not None else engine_rows(gw, request.app[SWITCHES])
    return web.json_response({"engines": rows}, dumps=lambda o: orjson.dumps(o).decode())


def engine_rows(gw: Gateway, switching: dict[str, asyncio.Task]) -> list[dict]:
    """``GET /admin/engines``' rows, from the process that runs the engines (``switching``: its :data:`SWITCHES`)."""
    configured = {e.name: e for e in gw.config.engines}
    rows = []
    for e in gw.registry:
        state = "switching" if e.id in switching else "draining" if e.draining else "healthy" if e.healthy else "unhealthy"
        rows.append({
            "id": e.id, "kind": configured[e.id].kind, "role": engine_role(gw, e.id), "pool": e.pool, "state": state,
            "gpus": configured[e.id].gpus, "url": e.url, "in_flight": e.in_flight, "in_flight_prompt_tokens": e.in_flight_prompt_tokens,
        })
    return rows


async def set_role(request: web.Request) -> web.Response:
    """``POST /admin/engines/{id}/role``: start moving the engine to another role (202; its own role: 200; see the module docstring)."""
    gw = _authorize(request)
    engine_id = request.match_info["id"]
    if engine_id not in {e.id for e in gw.registry}:
        raise APIError(404, f"no engine {engine_id!r}", type="not_found_error", param="id")
    try:
        body = orjson.loads(await read_body(request, gw.config.gateway.body_timeout_s))
    except orjson.JSONDecodeError as err:
        raise APIError(400, f"request body is not valid JSON: {err}") from None
    role = body.get("role") if isinstance(body, dict) else None
    drain_timeout_s = body.get("drain_timeout_s", 60.0) if isinstance(body, dict) else None
    if not isinstance(role, str) or role not in gw.config.roles:
        raise APIError(400, f"role: expected one of {', '.join(sorted(gw.config.roles))}, got {role!r}", param="role")
    if not isinstance(drain_timeout_s, (int, float)) or isinstance(drain_timeout_s, bool) or drain_timeout_s < 0:
        raise APIError(400, f"drain_timeout_s: expected seconds >= 0, got {drain_timeout_s!r}", param="drain_timeout_s")
    if gw.admin is not None:  # a gateway worker: the engines are the scheduler process's (gateway/workers.py)
        answer = await _ask_scheduler(gw, {"op": "admin_role", "engine": engine_id, "role": role, "drain_timeout_s": float(drain_timeout_s)})
        status, answer = answer["status"], answer["answer"]
    else:
        status, answer = begin_switch(gw, request.app[SWITCHES], engine_id, role, float(drain_timeout_s))
    return web.json_response(answer, status=status)


def begin_switch(gw: Gateway, switches: dict[str, asyncio.Task], engine_id: str, role: str, drain_timeout_s: float) -> tuple[int, dict]:
    """Start moving ``engine_id`` (an engine of ``gw``'s registry) to ``role`` (one of the config's), in the process
    that runs the engines; the HTTP status and body of the answer: 202 ``moving`` (same flags and plugin) or ``switching``, 200
    ``unchanged`` (its role already).

    Raises:
        APIError: 400 the role is of the other PD side where the engine cannot flip, or the engine is external;
            409 it is switching already.
    """
    try:
        check_side(gw, engine_id, role)
    except ValueError as err:
        raise APIError(400, f"role: {err}", param="role") from None
    if gw.manager is None or engine_id not in gw.manager.engines:
        raise APIError(400, f"engine {engine_id!r} runs outside laps (external): it cannot change role here", param="id")
    if engine_id in switches:
        raise APIError(409, f"engine {engine_id!r} is already switching role", type="conflict_error")
    if gw.manager.engines[engine_id].role == role:
        return 200, {"engine": engine_id, "role": role, "status": "unchanged"}
    instant = gw.config.instant_move(gw.manager.engines[engine_id].role, role)  # same flags and plugin: no drain, no restart
    start_switch(switches, gw, engine_id, role, drain_timeout_s)
    log.info("admin: engine %s %s role %s", engine_id, "moving at once to" if instant else "switching to", role)
    return 202, {"engine": engine_id, "role": role, "status": "moving" if instant else "switching"}


async def _ask_scheduler(gw: Gateway, message: dict) -> dict:
    """An admin call to the scheduler process (a gateway worker's :attr:`~gateway.state.Gateway.admin`); its answer.

    Raises:
        APIError: the scheduler's (as :func:`begin_switch`'s), or 503 ``scheduler_unavailable`` when it is not reachable.
    """
    answer = await gw.admin(message)
    error = answer.get("error")
    if error is not None:
        raise APIError(error["status"], error["message"], type=error["type"], param=error["param"], code=error["code"])
    return answer


def start_switch(switches: dict[str, asyncio.Task], gw: Gateway, engine_id: str, role: str, drain_timeout_s: float) -> asyncio.Task:
    """Start :func:`~gateway.role_switch.switch_role` as a task registered in ``switches`` (the app's
    :data:`SWITCHES`) until it ends, so ``GET /admin/engines`` shows the engine ``switching`` and no
    second switch of it can start (the admin API and the pressure controller both go through here)."""
    task = asyncio.get_running_loop().create_task(switch_role(gw, engine_id, role, drain_timeout_s))
    switches[engine_id] = task
    task.add_done_callback(lambda t: _switch_done(switches, engine_id, role, t))
    return task


def _switch_done(switches: dict, engine_id: str, role: str, task: asyncio.Task) -> None:
    switches.pop(engine_id, None)
    if not task.cancelled() and task.exception() is not None:
        log.error("engine %s could not switch to %s: %s", engine_id, role, task.exception())


def add_admin_routes(app: web.Application) -> None:
    """Register the admin routes (and their switch registry) on ``app``."""
    app[SWITCHES] = {}
    app.router.add_get("/admin/engines", list_engines)
    app.router.add_post("/admin/engines/{id}/role", set_role, expect_handler=expect_continue)
