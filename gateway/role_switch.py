"""Moving an engine to another role: drain it, restart it with the role's flags, route to it again."""

from __future__ import annotations

import asyncio
import logging
import time

from gateway.state import Gateway

log = logging.getLogger("laps.gateway")

DRAIN_POLL_S = 0.05


def check_same_side(gw: Gateway, engine_id: str, role: str) -> None:
    """Refuse a move between the prefill and decode sides of a PD deployment (the decode pool is sized in config).

    Raises:
        ValueError: ``role``'s pool is ``decode`` and the engine's is not, or the other way round.
    """
    pool, new_pool = gw.registry[engine_id].pool, gw.config.roles[role].pool
    if (pool == "decode") != (new_pool == "decode"):
        raise ValueError(f"engine {engine_id!r} serves the {pool} pool and role {role!r} the {new_pool} pool: engines move between the short and long prefill pools only; the decode pool is sized in the config")


async def switch_role(gw: Gateway, engine_id: str, role: str, drain_timeout_s: float = 60.0) -> None:
    """Move engine ``engine_id`` to ``role``'s pool: at once when the role keeps its flags, else by a restart with them.

    When ``role`` gives the engine the flags it runs with already
    (:meth:`laps.config.Config.instant_move`), the move is instant: the engine
    joins the new pool at once, keeping its requests and its cache. Otherwise:

    1. No new work goes to the engine (it is marked draining; the scheduler
       sends everything to the other engines meanwhile).
    2. Its in-flight requests finish, for at most ``drain_timeout_s`` seconds;
       those still running then end with an engine error when it stops.
    3. The manager restarts it on the same port with the new flags and waits
       until it is ready.
    4. Its prefix-cache estimate is dropped (the restart emptied its cache), it
       joins ``role``'s pool and is routed to again.

    Raises:
        ValueError: the gateway runs no engine processes, ``engine_id`` is not
            one of them (unknown or external), ``role`` is not defined, or it
            would move the engine between the prefill and decode sides.
        RuntimeError: the restarted engine did not become ready; it stays out
            of routing.
    """
    manager = gw.manager
    if manager is None or engine_id not in manager.engines:
        raise ValueError(f"engine {engine_id!r} is not an engine process of this gateway; only those can change role")
    if role not in gw.config.roles:
        raise ValueError(f"role {role!r} is not defined under roles; allowed: {', '.join(sorted(gw.config.roles))}")
    check_same_side(gw, engine_id, role)
    state = gw.registry[engine_id]
    process = manager.engines[engine_id]
    if gw.config.instant_move(process.role, role):
        process.role = role  # same flags: the engine runs on as it is; it only serves another pool
        state.pool = gw.config.roles[role].pool
        log.info("engine %s: serving as %s in the %s pool (same engine flags: no drain, no restart)", engine_id, role, state.pool)
        return
    state.draining = True
    started = time.monotonic()
    deadline = started + drain_timeout_s
    while state.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    if state.in_flight:
        log.warning("engine %s: %d requests still running after %.0f s of draining; they fail now", engine_id, state.in_flight, drain_timeout_s)
    log.info("engine %s: drained in %.1f s; restarting as %s", engine_id, time.monotonic() - started, role)
    await manager.restart(engine_id, role, gw.client.session)
    gw.prefix_index.forget_engine(engine_id)
    state.pool = gw.config.roles[role].pool
    if not state.healthy:  # the health poller saw the restart; it logs no recovery for a flag set here
        log.warning("engine %s is now healthy", engine_id)
    state.healthy = True
    state.draining = False
    log.info("engine %s: serving as %s in the %s pool after %.1f s", engine_id, role, state.pool, time.monotonic() - started)
