"""The app factory and the server's life: start engines, serve, shut down cleanly.

Start-up order (aiohttp ``cleanup_ctx``, each part cleaned only if it started):
tokenizer (a bad ``model.path`` fails before any engine starts) -> engine
client -> engine processes (unless given URLs) -> KV cache event followers (with ``scheduling.kv_events``,
:mod:`gateway.kv_events`) -> health poller -> pressure controller (with ``controller.enabled``). Shutdown runs the
same list backwards, so no engine outlives the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from typing import AsyncIterator

import aiohttp
from aiohttp import web

from engines.client import EngineClient
from engines.manager import EngineManager, kv_event_sources
from gateway import handlers, relay
from gateway.admin import SWITCHES, add_admin_routes
from gateway.controller_loop import CONTROLLER, ControllerLoop
from gateway.dispatcher import Dispatcher
from gateway.engine_load import fetch_engine_load
from gateway.errors import error_middleware
from gateway.kv_events import Following
from gateway.metrics import GatewayMetrics
from gateway.pd_dispatch import PDDispatch
from gateway.registry import EngineRegistry, EngineState
from gateway.state import GATEWAY, Gateway
from gateway.supervisor import EngineSupervisor
from laps.config import Config
from laps.cost import engine_traits
from laps.tokenizer import load_tokenizer
from policies.pool_signals import FirstTokenWindow
from policies.registry import make_classifier, make_scheduler
from policies.exact_prefix import PrefixCaches
from policies.prefix_index import PrefixIndex

log = logging.getLogger("laps.gateway")

HEALTH_POLL_INTERVAL_S = 1.0
MAX_BODY_BYTES = 64 * 1024 * 1024


async def _poll_health(gw: Gateway, supervisor: EngineSupervisor) -> None:
    while True:
        await asyncio.sleep(HEALTH_POLL_INTERVAL_S)
        for engine, ok in zip(list(gw.registry), await asyncio.gather(*(gw.client.ready(e.url) for e in gw.registry))):
            if ok != engine.healthy:
                log.warning("engine %s is now %s", engine.id, "healthy" if ok else "UNHEALTHY")
            engine.healthy = ok
            gw.metrics.engine_healthy.labels(engine.id).set(int(ok))
        supervisor.check()


async def _mirror_kv_capacity(client: EngineClient, registry: EngineRegistry, prefix_index: PrefixCaches) -> None:
    """Cap each engine's prefix estimate at its KV pool (``/v1/loads``) and record the pool on the engine's state (for
    ``policy: backlog``); an engine that does not say keeps the byte budget and no capacity."""
    for engine in registry:
        try:
            load = await fetch_engine_load(client, engine.url)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as err:
            log.warning("engine %s: no KV capacity from /v1/loads (%r); its prefix estimate uses the byte budget only", engine.id, err)
            continue
        prefix_index.set_capacity(engine.id, load.max_total_tokens)
        engine.kv_capacity_tokens = load.max_total_tokens


def create_app(config: Config, engine_urls: dict[str, str] | None = None) -> web.Application:
    """Build the gateway application for ``config``.

    ``engine_urls`` (``{engine name: base URL}``) serves engines that are
    already running; ``None`` launches the configured engines at start-up
    (``external`` ones are only addressed at their ``url``) and stops them at
    clean-up.
    """
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        tokenizer = await asyncio.get_running_loop().run_in_executor(None, load_tokenizer, config.model.path)
        client = EngineClient(config.gateway.request_timeout_s)
        await client.start()
        manager = EngineManager(config) if engine_urls is None else None
        try:
            urls = engine_urls if manager is None else await manager.start(client.session)
            registry = EngineRegistry([EngineState(e.name, urls[e.name], config.pool(e)) for e in config.engines])
            first_tokens = FirstTokenWindow(config.controller.window_s) if config.controller.enabled else None
            dispatcher = Dispatcher(make_scheduler(config.scheduling, engine_traits(config)), registry, first_tokens=first_tokens)
            prefix_index = PrefixCaches(PrefixIndex.from_byte_budget(config.scheduling.prefix_block_tokens, config.scheduling.prefix_index_bytes, len(config.engines)))
            await _mirror_kv_capacity(client, registry, prefix_index)
            gw = Gateway(config, tokenizer, registry, client, make_classifier(config.scheduling), dispatcher, prefix_index, GatewayMetrics(), manager)
            gw.pd = PDDispatch.from_config(config, urls) if config.pd is not None else None
            gw.metrics.watch_scheduler(dispatcher.scheduler.stats)
            app[GATEWAY] = gw
            following = Following(kv_event_sources(config, manager.engines if manager is not None else {}), prefix_index, gw.metrics)
            supervisor = EngineSupervisor(gw)
            poller = asyncio.create_task(_poll_health(gw, supervisor))
            if config.controller.enabled:
                app[CONTROLLER] = ControllerLoop(gw, app[SWITCHES])
                app[CONTROLLER].start()
            log.info("serving %s with %d engines: %s", config.model.name, len(urls), ", ".join(f"{k}={v}" for k, v in urls.items()))
            pd_mode = "off" if config.pd is None else f"on (decode placement {config.scheduling.decode_placement}, KV transfer {config.pd.transfer_backend})"
            log.info("scheduling policy %s; PD %s; controller %s", config.scheduling.policy, pd_mode, "on" if config.controller.enabled else "off")
            log.info("prefix hits: from the KV cache events of %s, estimated for the others", ", ".join(following.followers) or "no engine")
            yield
            poller.cancel()
            if CONTROLLER in app:
                await app[CONTROLLER].close()
            for switch in app[SWITCHES].values():  # admin role switches still draining or restarting
                switch.cancel()
            await asyncio.gather(*app[SWITCHES].values(), return_exceptions=True)
            await supervisor.close()
            await following.close()
            await relay.settle_background()
            dispatcher.close()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        finally:
            if manager is not None:
                await manager.stop()
            await client.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)
    add_admin_routes(app)
    return app


def app_runner(config: Config) -> web.AppRunner:
    """The runner of :func:`create_app` (``config``): handlers are cancelled when their client goes away."""
    return web.AppRunner(create_app(config), handler_cancellation=True, access_log=None, shutdown_timeout=5.0)


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (``0``: a free port the kernel picks; read it off the socket).

    Raises:
        OSError: the address cannot be bound (the port is taken, the host is not local); the message names it.
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as err:
        reason = os.strerror(err.errno) if err.errno and err.errno > 0 else err.strerror or str(err)  # < 0: getaddrinfo
        raise OSError(f"cannot listen on {host}:{port}: {reason}") from None


async def serve(config: Config) -> None:
    """Run the gateway until SIGINT or SIGTERM, then shut everything down.

    The port is bound before any engine starts, so a taken port fails at once. The ready line names the bound
    port (with ``gateway.port: 0``, the one the kernel picked).

    Raises:
        RuntimeError: an engine failed to start (its log tail is in the message).
        OSError: the gateway's port is taken.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sock = listen_socket(config.gateway.host, config.gateway.port)
    with sock:
        runner = app_runner(config)
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
            url = f"http://{config.gateway.host}:{sock.getsockname()[1]}"
            log.info("laps gateway listening on %s (Ctrl-C to stop)", url)
            print(f"laps: ready on {url}", flush=True)
            await stop.wait()
            log.info("shutting down")
        finally:
            await runner.cleanup()
