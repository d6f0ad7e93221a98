"""The gateway served from a background thread, so that a test can drive it with blocking clients and reach its state."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from aiohttp import web

from gateway.app import app_runner
from gateway.state import GATEWAY, Gateway
from laps.config import Config

T = TypeVar("T")


class LiveGateway:
    """:func:`gateway.app.app_runner` of ``config`` on ``config.gateway`` host and port, in a thread with its own loop.

    A context manager: entering starts the configured engines (as ``laps
    serve`` does) and returns once the gateway listens, within
    ``start_timeout_s``; leaving stops the gateway and its engines.

    Raises (on enter):
        RuntimeError: the gateway did not start in time.
        Exception: whatever start-up raised (e.g. an engine that never got ready).
    """

    def __init__(self, config: Config, start_timeout_s: float = 300.0) -> None:
        self.config = config
        self.start_timeout_s = start_timeout_s
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="live-gateway", daemon=True)
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """The gateway's base URL (``http://host:port``)."""
        return f"http://{self.config.gateway.host}:{self.config.gateway.port}"

    @property
    def gateway(self) -> Gateway:
        """The running gateway's state (touch it only through :meth:`run` when it must not race the loop)."""
        return self._runner.app[GATEWAY]

    @property
    def app(self) -> web.Application:
        """The running gateway's aiohttp application (its app keys: admin switches, controller, ...)."""
        return self._runner.app

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run ``coro`` on the gateway's loop and return its result (or raise its exception)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def __enter__(self) -> "LiveGateway":
        self._thread.start()
        if not self._started.wait(self.start_timeout_s):
            raise RuntimeError(f"the gateway did not start within {self.start_timeout_s:.0f} s")
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        runner = app_runner(self.config)
        try:
            await runner.setup()
            await web.TCPSite(runner, self.config.gateway.host, self.config.gateway.port).start()
        except BaseException as err:
            self._error = err
            self._started.set()
            with contextlib.suppress(Exception):
                await runner.cleanup()
            return
        self._runner = runner
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
