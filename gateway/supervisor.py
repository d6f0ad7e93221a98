"""Restarting crashed engine processes, with exponential backoff.

The health poller calls :meth:`EngineSupervisor.check` once per round. An
engine process laps started that has exited is restarted with its current
role on its own port; a restart that fails, or an engine that dies again
soon, waits twice as long before the next try (1 s, 2 s, 4 s ... 60 s). The
engine's prefix-cache estimate is dropped (a restarted engine starts cold).
Requests that were on it have already ended with an explicit error, or were
retried on another engine if nothing had reached their client.
"""

from __future__ import annotations

import asyncio
import logging
import time

from gateway.state import Gateway

log = logging.getLogger("laps.engines")

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0


class EngineSupervisor:
    """Watches the gateway's engine processes and restarts the dead ones (see the module docstring)."""

    def __init__(self, gw: Gateway, clock=time.monotonic) -> None:
        self._gw = gw
        self._clock = clock
        self._backoff_s: dict[str, float] = {}
        self._not_before_s: dict[str, float] = {}
        self._restarts: dict[str, asyncio.Task] = {}
        self._failed: set[str] = set()  # engines whose last restart failed, perhaps before a process started

    def check(self) -> None:
        """Start a restart for every dead engine whose backoff has passed."""
        manager = self._gw.manager
        if manager is None:
            return
        now = self._clock()
        for name, engine in manager.engines.items():
            if ((engine.process is None and name not in self._failed) or engine.alive() or engine.restarting or name in self._restarts
                    or now < self._not_before_s.get(name, 0.0)):
                continue
            delay = self._backoff_s.get(name, FIRST_BACKOFF_S)
            self._backoff_s[name] = min(2 * delay, MAX_BACKOFF_S)
            self._not_before_s[name] = now + delay
            if engine.process is None:
                log.error("engine %s: its last restart started no process; restarting again", name)
            else:
                log.error("engine %s: process exited with code %s (log: %s); restarting", name, engine.process.returncode, engine.log_path)
            task = asyncio.get_running_loop().create_task(self._restart(name, engine.role))
            self._restarts[name] = task

    async def _restart(self, name: str, role: str) -> None:
        gw = self._gw
        try:
            await gw.manager.restart(name, role, gw.client)
        except Exception as err:  # a failed restart is retried after the backoff, never fatal
            log.error("engine %s: restart failed: %s", name, err)
            self._failed.add(name)
        else:
            self._failed.discard(name)
            gw.prefix_index.forget_engine(name)
            log.info("engine %s: restarted and ready", name)
        finally:
            del self._restarts[name]

    async def close(self) -> None:
        """Cancel restarts in progress (the gateway is shutting down)."""
        for task in list(self._restarts.values()):
            task.cancel()
        await asyncio.gather(*self._restarts.values(), return_exceptions=True)
