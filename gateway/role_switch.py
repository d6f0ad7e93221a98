"""Moving an engine to another role: at once, or drain it and flip it (SGLang's PD role switch) or restart it, then route to it again."""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from engines.client import EngineHTTPError
from gateway.engine_load import read_capacity
from gateway.registry import EngineState
from gateway.state import Gateway

log = logging.getLogger("laps.gateway")

DRAIN_POLL_S = 0.05
FLIP_TIMEOUT_S = 120.0  # a flip to decode captures decode CUDA graphs (seconds on a GPU)
NOT_IDLE = "instance is not idle; drain all requests before switching"  # SGLang 0.5.23 disaggregation/role_switch.py


def check_side(gw: Gateway, engine_id: str, role: str) -> None:
    """Refuse a move between the prefill and decode sides of a PD deployment unless ``pd.role_switch`` is on.

    Raises:
        ValueError: ``role``'s pool is ``decode`` and the engine's is not, or the other way round, without ``pd.role_switch``.
    """
    pool, new_pool = gw.registry[engine_id].pool, gw.config.roles[role].pool
    if (pool == "decode") != (new_pool == "decode") and not (gw.config.pd is not None and gw.config.pd.role_switch):
        raise ValueError(f"engine {engine_id!r} serves the {pool} pool and role {role!r} the {new_pool} pool: engines move between the short and long prefill pools only; the decode pool is sized in the config (set pd.role_switch to flip engines between prefill and decode)")


async def switch_role(gw: Gateway, engine_id: str, role: str, drain_timeout_s: float = 60.0) -> None:
    """Move engine ``engine_id`` to ``role``'s pool: at once when the role keeps its flags, else by a flip or a restart.

    When ``role`` gives the engine the flags it runs with already and keeps it
    on its side of a PD deployment (:meth:`laps.config.Config.instant_move`),
    the move is instant: the engine joins the new pool at once, keeping its
    requests and its cache. Otherwise:

    1. No new work goes to the engine (it is marked draining; the scheduler
       sends everything to the other engines meanwhile).
    2. Its in-flight requests finish, for at most ``drain_timeout_s`` seconds.
    3. A move between a prefill role and the decode role with the same flags (and plugin)
       under ``pd.role_switch`` (:meth:`laps.config.Config.pd_flip`) flips the
       engine in place (:func:`flip`); any other move has the manager restart it
       on the same port with the new flags (requests still running then end
       with an engine error) and waits until it is ready.
    4. Its prefix-cache estimate is dropped (the flip or the restart emptied
       its cache), its KV pool and request slots are read again (the new
       flags may change them), it joins ``role``'s pool and is routed to again.

    Raises:
        ValueError: the gateway runs no engine processes, ``engine_id`` is not
            one of them (unknown or external), ``role`` is not defined, or it
            would move the engine between the prefill and decode sides without
            ``pd.role_switch``.
        RuntimeError: the restarted engine did not become ready; it stays out
            of routing. Or the engine refused the flip, or could not be
            reached for it: it serves its old role again.
    """
    manager = gw.manager
    if manager is None or engine_id not in manager.engines:
        raise ValueError(f"engine {engine_id!r} is not an engine process of this gateway; only those can change role")
    if role not in gw.config.roles:
        raise ValueError(f"role {role!r} is not defined under roles; allowed: {', '.join(sorted(gw.config.roles))}")
    check_side(gw, engine_id, role)
    state = gw.registry[engine_id]
    process = manager.engines[engine_id]
    if gw.config.instant_move(process.role, role):
        process.role = role  # same flags and plugin: the engine runs on as it is; it only serves another pool
        state.pool = gw.config.roles[role].pool
        log.info("engine %s: serving as %s in the %s pool (same engine flags and plugin: no drain, no restart)", engine_id, role, state.pool)
        return
    state.draining = True
    started = time.monotonic()
    deadline = started + drain_timeout_s
    while state.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    if gw.config.pd_flip(process.role, role) and await flip(gw, state, role, deadline):
        process.role = role
    else:
        if state.in_flight:
            log.warning("engine %s: %d requests still running after %.0f s of draining; they fail now", engine_id, state.in_flight, drain_timeout_s)
        log.info("engine %s: drained in %.1f s; restarting as %s", engine_id, time.monotonic() - started, role)
        await manager.restart(engine_id, role, gw.client)
    gw.prefix_index.forget_engine(engine_id)
    await read_capacity(gw.client, state, gw.prefix_index)
    state.pool = gw.config.roles[role].pool
    if not state.healthy:  # the health poller saw the restart; it logs no recovery for a flag set here
        log.info("engine %s is now healthy", engine_id)
    state.healthy = True
    state.draining = False
    log.info("engine %s: serving as %s in the %s pool after %.1f s", engine_id, role, state.pool, time.monotonic() - started)


async def flip(gw: Gateway, state: EngineState, role: str, deadline: float) -> bool:
    """Flip the drained engine ``state`` to ``role``'s side with SGLang 0.5.23's ``POST /pd_role_switch``.

    The body is ``{"new_role": "prefill" | "decode"}``, plus ``decode_cuda_graph_memory_gb``
    (``pd.decode_cuda_graph_memory_gb``) for a flip to decode. An engine that answers ``instance is not
    idle`` is asked again every :data:`DRAIN_POLL_S` until ``deadline`` (``time.monotonic()``). True once
    the engine answers success; False when it answers that it is unhealthy and must restart
    (``safe_to_restore`` false), for the caller to restart it.

    Raises:
        RuntimeError: the engine refused the flip (still busy at ``deadline``, or any other refusal it may
            recover from), or could not be reached; it is routed to again in its old role (draining cleared).
    """
    new_role = "decode" if gw.config.roles[role].pool == "decode" else "prefill"
    body: dict = {"new_role": new_role}
    if new_role == "decode":
        body["decode_cuda_graph_memory_gb"] = gw.config.pd.decode_cuda_graph_memory_gb
    while True:
        try:
            async with gw.client.post(state.url, "/pd_role_switch", body, timeout_s=FLIP_TIMEOUT_S) as resp:
                status, answer = resp.status, orjson.loads(await resp.read())
            if not isinstance(answer, dict):
                answer = {"message": f"unexpected answer {answer!r}"}
        except (EngineHTTPError, orjson.JSONDecodeError) as err:
            state.draining = False
            raise RuntimeError(f"engine {state.id}: POST /pd_role_switch failed: {err!r}; it serves as before") from None
        if status == 200 and answer.get("success"):
            log.info("engine %s: flipped from %s to %s in place (POST /pd_role_switch: %s)", state.id, answer.get("old_role"), new_role, answer.get("message"))
            return True
        message = answer.get("message") or answer
        if answer.get("message") == NOT_IDLE and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
            continue
        if answer.get("safe_to_restore") is False:
            log.error("engine %s: the flip to %s failed and left it unhealthy (%s); restarting it", state.id, new_role, message)
            return False
        state.draining = False
        raise RuntimeError(f"engine {state.id} refused the flip to {new_role}: {message}; it serves as before")
