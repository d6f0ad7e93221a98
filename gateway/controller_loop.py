"""The pressure controller in the live gateway: every ``controller.interval_s``, signals → decision → role switch.

Signals (:func:`policies.pool_signals.engine_signals`, the function the
virtual-time simulator uses too) come from the gateway's own counters (the
requests the dispatcher holds undispatched; the first tokens the dispatcher
saw, against their deadlines) and each serving engine's ``/v1/loads``; where
the controller sizes the decode pool (:meth:`laps.config.Config.controller_sizes_decode`),
the decode engines' too. A move is the admin API's role switch
(:func:`gateway.admin.start_switch`; across the PD sides a flip in place where
the roles' flags are equal), so ``GET /admin/engines`` shows the engine
``switching`` and a manual move of it is refused meanwhile. Metrics: ``laps_pool_engines{pool}``,
``laps_pool_pressure{pool}``, ``laps_controller_moves_total{from_pool,to_pool,outcome}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from functools import partial

from aiohttp import web

from engines.client import EngineHTTPError
from gateway.admin import start_switch
from gateway.engine_load import fetch_engine_load
from gateway.state import Gateway
from policies.controller import POOLS, EngineSignals, Move
from policies.pool_signals import FirstTokenWindow, LoadSample, engine_signals, queued_new_tokens
from policies.registry import make_controller

log = logging.getLogger("laps.gateway")


class ControllerLoop:
    """Runs the pool controller (:func:`policies.registry.make_controller`) on ``gw`` (``gw.dispatcher`` must record first tokens).

    ``switches`` is the app's registry of role switches in progress
    (:data:`gateway.admin.SWITCHES`). :meth:`start` starts the periodic task,
    :meth:`close` stops it (a move in progress goes on; the app cancels it at
    shutdown); :meth:`step` is one decision.

    Raises:
        ValueError: ``gw.dispatcher.first_tokens`` is ``None``.
    """

    def __init__(self, gw: Gateway, switches: dict[str, asyncio.Task]) -> None:
        if gw.dispatcher.first_tokens is None:
            raise ValueError("the controller needs a dispatcher that records first tokens (Dispatcher(first_tokens=...))")
        self.gw = gw
        self.switches = switches
        self.sizes_decode = gw.config.controller_sizes_decode()
        self.controller = make_controller(gw.config.controller.pressure_config(), self.sizes_decode)
        self.pools = (*POOLS, "decode") if self.sizes_decode else POOLS  # the pools exported as metrics
        self.first_tokens: FirstTokenWindow = gw.dispatcher.first_tokens
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.gw.config.controller.interval_s)
            try:
                await self.step()
            except Exception:  # a bad poll must not end the controller
                log.exception("controller: decision failed")

    async def signals(self) -> list[EngineSignals]:
        """Signals of the engines serving the short and long pools now (healthy, not draining or switching, load read),
        then of the decode engines serving alike when the controller sizes the decode pool."""
        gw = self.gw
        views = [v for v in gw.registry.views() if v.id not in self.switches]
        decode = [v for v in gw.registry.decode_views() if v.id not in self.switches] if self.sizes_decode else []
        serving = [v for v in views + decode if v.healthy]
        results = await asyncio.gather(*(fetch_engine_load(gw.client, gw.registry[v.id].url) for v in serving), return_exceptions=True)
        loads = {}
        for view, load in zip(serving, results):
            if isinstance(load, (EngineHTTPError, ValueError)):
                log.warning("controller: no load from engine %s (%r); it sits this decision out", view.id, load)
                continue
            if isinstance(load, BaseException):
                raise load
            loads[view.id] = LoadSample(load.waiting_uncached_tokens, load.running_requests, load.token_usage,
                                        load.waiting_requests, load.max_running_requests)
        movable = set(gw.manager.engines) if gw.manager is not None else set()
        fixed = {v.id for v in views + decode} - movable
        return engine_signals(views, queued_new_tokens(gw.dispatcher.queued_requests()), loads, self.first_tokens,
                              gw.dispatcher.clock(), fixed, decode)

    async def step(self) -> Move | None:
        """One decision: read the signals, export the pools, start the move if there is one; the move or ``None``."""
        gw = self.gw
        signals = await self.signals()
        move = self.controller.decide(signals, gw.dispatcher.clock())
        stats = self.controller.stats()
        for pool in self.pools:
            gw.metrics.pool_engines.labels(pool).set(stats[f"pool_size_{pool}"])
            gw.metrics.pool_pressure.labels(pool).set(stats[f"pool_pressure_{pool}"])
        if move is None:
            return None
        role = gw.config.controller.role_for(move.to_pool)
        pools = ", ".join(f"{pool} {stats[f'pool_size_{pool}']} at {stats[f'pool_pressure_{pool}']:.3f}" for pool in self.pools)
        log.info("controller: moving engine %s from the %s pool to the %s pool as %s (τ %.3g; engines and pressure per pool: %s%s)",
                 move.engine_id, move.from_pool, move.to_pool, role, self.controller.config.hysteresis, pools,
                 f"; prefill side {stats['pool_pressure_prefill']:.3f}" if self.sizes_decode else "")
        task = start_switch(self.switches, gw, move.engine_id, role, gw.config.controller.drain_timeout_s)
        task.add_done_callback(partial(self._move_done, move))
        return move

    def _move_done(self, move: Move, task: asyncio.Task) -> None:
        ok = not task.cancelled() and task.exception() is None
        self.first_tokens.forget_engine(move.engine_id)
        self.controller.on_move_done(move.engine_id, self.gw.dispatcher.clock())
        self.gw.metrics.controller_moves.labels(move.from_pool, move.to_pool, "ok" if ok else "failed").inc()
        log.info("controller: engine %s %s the %s pool", move.engine_id, "joined" if ok else "could not join", move.to_pool)


CONTROLLER = web.AppKey("controller", ControllerLoop)
"""The app's running :class:`ControllerLoop` (present only with ``controller.enabled``)."""
