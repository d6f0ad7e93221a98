"""The app factory and the server's life: start engines, serve, shut down cleanly.

Start-up order (aiohttp ``cleanup_ctx``, each part cleaned only if it started):
tokenizer (a bad ``model.path`` fails before any engine starts) -> engine
client -> engine processes (unless given URLs) -> KV cache event followers (with ``scheduling.kv_events``,
:mod:`gateway.kv_events`) -> health poller -> pressure controller (with ``controller.enabled``). Shutdown runs the
same list backwards, so no engine outlives the gateway.

Shutdown (:func:`serve`, on SIGINT or SIGTERM): the gateway stops listening and
answers new requests on open connections with 503, lets the requests in flight
run for up to ``gateway.shutdown_grace_s``, then ends those left with an
explicit error (:func:`end_requests`), then stops the engines. A second signal
exits at once (the engines, started with a parent-death signal, follow). A signal
during the start-up cancels it (:func:`start_or_interrupt`): the engines started
so far are stopped.

With ``gateway.workers`` > 1 (:mod:`gateway.workers`) the scheduler process runs
:func:`create_app`'s start-up without serving HTTP, and each worker serves
:func:`create_worker_app` through :func:`serve_until`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from functools import partial
from typing import TYPE_CHECKING, AsyncIterator

import time

import orjson
from aiohttp import web

from engines.client import EngineClient, EngineHTTPError
from engines.manager import EngineManager, kv_event_sources
from gateway import handlers, relay, tracing
from gateway.admin import SWITCHES, add_admin_routes
from gateway.controller_loop import CONTROLLER, ControllerLoop
from gateway.dispatcher import Dispatcher, classify
from gateway.engine_load import read_capacity
from gateway.auth import api_key_middleware, is_loopback
from gateway.errors import ServerLog, ShuttingDown, error_middleware, expect_continue
from gateway.health import HealthMonitor, end_waits_on, watch_silence
from gateway.kv_events import Following
from gateway.metrics import GatewayMetrics
from gateway.pd_setup import PDDispatch, bootstrap_addresses
from gateway.registry import EngineRegistry, EngineState
from gateway.sched_channel import ChannelClient
from gateway.sched_worker import (CONNECT_WITHIN_S, RemoteDecodeSide, RemoteDispatcher, RemotePrefixIndex, StatePoller, admin_caller,
                                  registry_of, report_out_of_service)
from gateway.state import GATEWAY, Gateway
from gateway.supervisor import EngineSupervisor
from laps.api_keys import load_keys
from laps.config import Config, GatewayConfig
from laps.cost import engine_traits
from laps.heap import freeze_heap
from laps.tokenizer import load_tokenizer
from policies.pool_signals import FirstTokenWindow
from policies.registry import make_classifier, make_scheduler
from policies.exact_prefix import PrefixCaches
from policies.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

log = logging.getLogger("laps.gateway")

MAX_BODY_BYTES = 64 * 1024 * 1024
# Once the grace period is over, how long the requests still running get to write their error and finish (seconds).
END_REQUESTS_S = 2.0


async def _context_tokens(client: EngineClient, registry: EngineRegistry) -> int | None:
    """The model's context length (tokens): the least ``max_model_len`` the engines' ``GET /v1/models`` lists (SGLang
    and the simulated engine list it); ``None`` when no engine says (prompts are then not checked against it)."""
    lengths = []
    for engine in registry:
        try:
            value = orjson.loads(await client.get(engine.url, "/v1/models"))["data"][0].get("max_model_len")
        except (EngineHTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
            log.warning("engine %s: no max_model_len from /v1/models (%r)", engine.id, err)
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            lengths.append(value)
    return min(lengths, default=None)


def create_app(config: Config, engine_urls: dict[str, str] | None = None, span_exporter: SpanExporter | None = None) -> web.Application:
    """Build the gateway application for ``config``.

    ``engine_urls`` (``{engine name: base URL}``) serves engines that are
    already running; ``None`` launches the configured engines at start-up
    (``external`` ones are only addressed at their ``url``) and stops them at
    clean-up. With ``tracing.enabled``, request spans go to ``span_exporter``
    (default: OTLP to ``tracing.endpoint``; see :mod:`gateway.tracing`).
    """
    app, provider, tracer = _application(config, span_exporter)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        tokenizer = await asyncio.get_running_loop().run_in_executor(None, load_tokenizer, config.model.path)
        client = EngineClient(config.gateway.request_timeout_s, tracer=tracer)
        await client.start()
        manager = EngineManager(config) if engine_urls is None else None
        try:
            urls = engine_urls if manager is None else await manager.start(client)
            registry = EngineRegistry([EngineState(e.name, urls[e.name], config.pool(e)) for e in config.engines])
            first_tokens = FirstTokenWindow(config.controller.window_s, config.controller.min_first_tokens) if config.controller.enabled else None
            prefix_index = PrefixCaches(PrefixIndex.from_byte_budget(config.scheduling.prefix_block_tokens, config.scheduling.prefix_index_bytes, len(config.engines)))
            classifier = make_classifier(config.scheduling)
            dispatcher = Dispatcher(make_scheduler(config.scheduling, engine_traits(config)), registry, first_tokens=first_tokens,
                                    classify=partial(classify, config=config, registry=registry, prefix_index=prefix_index,
                                                     classifier=classifier),
                                    prefills=prefix_index.in_flight)
            for engine in registry:
                await read_capacity(client, engine, prefix_index)
            context_tokens = await _context_tokens(client, registry)
            gw = Gateway(config, tokenizer, registry, client, dispatcher, prefix_index, GatewayMetrics(), manager,
                         tracer=tracer,
                         api_keys=load_keys(config.gateway.api_keys) if config.gateway.api_keys is not None else None,
                         context_tokens=context_tokens)
            gw.pd = PDDispatch.from_config(config, urls) if config.pd is not None else None
            gw.metrics.watch_scheduler(dispatcher.scheduler.stats)
            gw.metrics.memory_budget.labels("prefix_index").set(config.scheduling.prefix_index_bytes)
            gw.metrics.memory_budget.labels("chat_cache").set(config.scheduling.chat_cache_bytes)
            app[GATEWAY] = gw
            following = Following(kv_event_sources(config, manager.engines if manager is not None else {}), prefix_index, gw.metrics)
            supervisor = EngineSupervisor(gw)
            monitor = HealthMonitor(gw)
            poller = asyncio.create_task(monitor.run(supervisor.check))
            if config.controller.enabled:
                app[CONTROLLER] = ControllerLoop(gw, app[SWITCHES])
                app[CONTROLLER].start()
            log.info("serving %s with %d engines: %s", config.model.name, len(urls), ", ".join(f"{k}={v}" for k, v in urls.items()))
            pd_mode = "off" if config.pd is None else f"on (decode placement {config.scheduling.decode_placement}, KV transfer {config.pd.transfer_backend})"
            policy = config.scheduling.policy
            if policy == "laps":
                policy += f" (AWD windows {'on' if config.scheduling.laps.awd_windows else 'off'})"
            log.info("scheduling policy %s; PD %s; controller %s", policy, pd_mode, "on" if config.controller.enabled else "off")
            if gw.api_keys is None and not is_loopback(config.gateway.host):
                log.warning("gateway.host is %s, reachable from other machines, and gateway.api_keys is not set: "
                            "any client can use the /v1 API; set gateway.api_keys", config.gateway.host)
            sink = f"by OTLP/HTTP to {config.tracing.endpoint}" if span_exporter is None else f"to {type(span_exporter).__name__}"
            log.info("tracing %s", f"on: spans {sink} as {config.tracing.service_name}, sample ratio {config.tracing.sample_ratio:g}"
                     if tracer is not None else "off (tracing.enabled: false)")
            log.info("context length %s", f"{context_tokens} tokens: longer requests get 400 context_length_exceeded"
                     if context_tokens is not None else "unknown (no engine lists max_model_len): prompts are not checked against it")
            log.info("prefix hits: from the KV cache events of %s, estimated for the others", ", ".join(following.followers) or "no engine")
            yield
            poller.cancel()
            await monitor.close()
            if CONTROLLER in app:
                await app[CONTROLLER].close()
            for switch in app[SWITCHES].values():  # admin role switches still draining or restarting
                switch.cancel()
            await asyncio.gather(*app[SWITCHES].values(), return_exceptions=True)
            await supervisor.close()
            await following.close()
            await relay.settle_background()
            dispatcher.close()
            await gw.encoder.close()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        finally:
            if manager is not None:
                await manager.stop()
            await client.close()
            if provider is not None:
                await asyncio.get_running_loop().run_in_executor(None, provider.shutdown)  # exports the spans still batched

    app.cleanup_ctx.append(lifecycle)
    return app


def _application(config: Config, span_exporter: SpanExporter | None) -> tuple[web.Application, TracerProvider | None, Tracer | None]:
    """The gateway's aiohttp application with its middlewares and routes, no life yet; its tracer provider and
    tracer (``None``, ``None`` with tracing off)."""
    provider = tracing.tracer_provider(config.tracing, span_exporter) if config.tracing.enabled else None
    tracer = provider.get_tracer("laps.gateway") if provider is not None else None
    middlewares = [error_middleware, api_key_middleware]
    if tracer is not None:
        middlewares.insert(0, tracing.tracing_middleware(tracer))
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions, expect_handler=expect_continue)
    app.router.add_post("/v1/completions", handlers.completions, expect_handler=expect_continue)
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/v1/models/{model:.+}", handlers.retrieve_model)  # a model id may hold '/' (org/name)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)
    add_admin_routes(app)
    return app, provider, tracer


def create_worker_app(config: Config, channel_path: str) -> web.Application:
    """The application of one gateway worker (``gateway.workers`` > 1): the same routes as :func:`create_app`, its
    decisions and prefix index the scheduler process's, over the channel at ``channel_path``
    (:mod:`gateway.sched_worker`). It starts no engine, polls no health, runs no controller: the scheduler does.

    Start-up raises ``OSError`` when the scheduler does not listen at ``channel_path`` within
    :data:`~gateway.sched_worker.CONNECT_WITHIN_S` (one started just before the scheduler died waits for the next).
    """
    app, provider, tracer = _application(config, None)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        tokenizer = await asyncio.get_running_loop().run_in_executor(None, load_tokenizer, config.model.path)
        client = EngineClient(config.gateway.request_timeout_s, tracer=tracer)
        await client.start()
        channel: ChannelClient | None = None
        try:
            channel = await ChannelClient.connect(channel_path, reconnect=True, within_s=CONNECT_WITHIN_S)
            state = await channel.call({"op": "state"})
            registry = registry_of(state["engines"])
            dispatcher = RemoteDispatcher(channel)
            gw = Gateway(config, tokenizer, registry, client, dispatcher,
                         RemotePrefixIndex(channel, config.scheduling.prefix_block_tokens), GatewayMetrics(), tracer=tracer,
                         api_keys=load_keys(config.gateway.api_keys) if config.gateway.api_keys is not None else None,
                         context_tokens=state["context_tokens"], report_out_of_service=partial(report_out_of_service, channel),
                         admin=admin_caller(channel))
            if config.pd is not None:
                gw.pd = RemoteDecodeSide(channel, dispatcher, bootstrap_addresses(config, {e.id: e.url for e in registry}))
            poller = StatePoller(channel, registry, state, left_service=partial(end_waits_on, gw))
            gw.engine_roles = poller.roles
            gw.metrics.watch_scheduler(lambda: poller.stats)
            silence = asyncio.create_task(watch_silence(gw))  # this worker's streams: only it sees them
            app[GATEWAY] = gw
            yield
            silence.cancel()
            await poller.close()
            await relay.settle_background()
            await gw.encoder.close()
        finally:
            if channel is not None:
                await channel.close()
            await client.close()
            if provider is not None:
                await asyncio.get_running_loop().run_in_executor(None, provider.shutdown)

    app.cleanup_ctx.append(lifecycle)
    return app


def app_runner(config: Config, app: web.Application | None = None) -> web.AppRunner:
    """The runner of ``app`` (default: :func:`create_app` of ``config``): handlers are cancelled when their client
    goes away; a connection without a whole request head for ``gateway.keepalive_timeout_s`` (idle, or sending its
    headers slowly) is closed. (``gateway.body_timeout_s`` is the handlers': :func:`gateway.handlers.read_body`.)
    A request aiohttp cannot parse gets its plain-text 400 and one INFO log line (:class:`gateway.errors.ServerLog`).
    Bodies come as sent: the handlers decode a ``Content-Encoding`` (:mod:`gateway.content_encoding`)."""
    return web.AppRunner(app if app is not None else create_app(config), handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                         keepalive_timeout=config.gateway.keepalive_timeout_s, logger=ServerLog(), auto_decompress=False)


def listen_socket(host: str, port: int, reuse_port: bool = False, listen: bool = True,
                  backlog: int = GatewayConfig.model_fields["listen_backlog"].default) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (``0``: a free port the kernel picks; read it off the socket), listening
    with a queue of ``backlog`` accepted connections (``gateway.listen_backlog``) unless ``listen`` is false; with
    ``reuse_port``, ``SO_REUSEPORT``: other such sockets may bind the same port and the kernel spreads connections
    over those that listen. (:func:`serve_until` listens again with the same backlog: aiohttp's site calls
    ``listen()`` too.)

    Raises:
        OSError: the address cannot be bound (the port is taken, the host is not local); the message names it.
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        if listen:
            return socket.create_server((host, port), family=family, backlog=backlog, reuse_port=reuse_port)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(reuse_port))
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        return sock
    except OSError as err:
        reason = os.strerror(err.errno) if err.errno and err.errno > 0 else err.strerror or str(err)  # < 0: getaddrinfo
        raise OSError(f"cannot listen on {host}:{port}: {reason}") from None


async def end_requests(gw: Gateway, grace_s: float) -> None:
    """Shut the request side down: take no new request, let those in flight run up to ``grace_s`` seconds, then end
    the rest with :class:`~gateway.errors.ShuttingDown` (queued ones with a 503, started streams with an error
    event and ``[DONE]``) and give them ``END_REQUESTS_S`` to write it."""
    gw.closing = True
    deadline = time.monotonic() + grace_s
    if gw.guards:
        n = len(gw.guards)
        log.info("shutting down: %d request%s in flight get%s up to %.0f s to finish", n, "" if n == 1 else "s",
                 "s" if n == 1 else "", grace_s)
    while gw.guards and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if gw.guards:
        log.warning("shutting down: ending the %d requests still running after %.0f s", len(gw.guards), grace_s)
        gw.dispatcher.fail_waiting(ShuttingDown)
        for guard in list(gw.guards):
            guard.shut()
        deadline = time.monotonic() + END_REQUESTS_S
        while gw.guards and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


async def serve(config: Config) -> None:
    """Run the gateway until SIGINT or SIGTERM, then shut everything down (see the module docstring).

    The port is bound before any engine starts, so a taken port fails at once. The ready line names the bound
    port (with ``gateway.port: 0``, the one the kernel picked). A signal during the start-up cancels it
    (:func:`start_or_interrupt`).

    Raises:
        RuntimeError: an engine failed to start (its log tail is in the message).
        OSError: the gateway's port is taken.
        StartInterrupted: a SIGINT or SIGTERM came before the gateway was ready; the engines started are stopped.
    """
    stop = stop_on_signals((signal.SIGINT, signal.SIGTERM))
    sock = listen_socket(config.gateway.host, config.gateway.port, backlog=config.gateway.listen_backlog)

    def ready(url: str) -> None:
        log.info("laps gateway listening on %s (Ctrl-C to stop; twice to stop at once)", url)
        print(f"laps: ready on {url}", flush=True)

    await serve_until(config, app_runner(config), sock, stop, ready)


class StopEvent(asyncio.Event):
    """An :class:`asyncio.Event` that :func:`stop_on_signals` sets; ``signum``: the signal that set it (``None``
    before, or when it was set otherwise)."""

    signum: int | None = None


class StartInterrupted(Exception):
    """A SIGINT or SIGTERM (``signum``; ``None``: the stop event was set otherwise) came while the gateway was
    starting: the start-up was cancelled and the engines it had started were stopped."""

    def __init__(self, signum: int | None) -> None:
        super().__init__(f"interrupted during start-up ({signal.Signals(signum).name if signum else 'stop'})")
        self.signum = signum


def stop_on_signals(signals: tuple[signal.Signals, ...]) -> StopEvent:
    """An event set at the first of ``signals`` (its ``signum`` says which); the second exits the process at once
    (code 130)."""
    stop = StopEvent()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if not stop.is_set():
            stop.signum = signum
            stop.set()
            return
        log.warning("second signal: exiting now")
        logging.shutdown()
        os._exit(130)

    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    return stop


async def start_or_interrupt(runner: web.AppRunner, stop: asyncio.Event) -> None:
    """``runner.setup()`` (the app's start-up: with engines to launch, until every one is ready) unless ``stop`` is
    set before it ends: then the start-up is cancelled, which stops the engines it had started (an engine that
    exited meanwhile, e.g. by the same Ctrl-C, is not an engine failure), and :class:`StartInterrupted` is raised.

    Raises:
        StartInterrupted: ``stop`` was set first (its ``signum`` when it is a :class:`StopEvent`).
        Exception: whatever the start-up raises while ``stop`` is not set (e.g. RuntimeError: an engine failed to start).
    """
    setup = asyncio.ensure_future(runner.setup())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((setup, stopped), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        setup.cancel()
        raise
    finally:
        stopped.cancel()
    if not stop.is_set():
        setup.result()  # the start-up's error, if any
        freeze_heap()  # what the start-up built lives as long as the process: out of the collector's full passes
        return
    signum = getattr(stop, "signum", None)
    log.info("interrupted during start-up (%s): stopping the engines started so far", signal.Signals(signum).name if signum else "stop")
    setup.cancel()
    await asyncio.wait((setup,))
    if not setup.cancelled() and setup.exception() is not None:
        log.debug("the interrupted start-up ended with: %s", setup.exception())
    await runner.cleanup()  # what had started (all of it when the start-up had just ended)
    raise StartInterrupted(signum)


async def serve_until(config: Config, runner: web.AppRunner, sock: socket.socket, stop: asyncio.Event, ready) -> None:
    """Start ``runner`` (its app's start-up; :func:`start_or_interrupt`), serve it on the listening ``sock``, call
    ``ready(url)``, and when ``stop`` is set shut down as the module docstring says (``sock`` is closed at the end).

    Raises:
        StartInterrupted: ``stop`` was set during the start-up (the engines started are stopped).
        Exception: whatever the app's start-up raises (e.g. RuntimeError: an engine failed to start).
    """
    with sock:
        await start_or_interrupt(runner, stop)
        try:
            site = web.SockSite(runner, sock, backlog=config.gateway.listen_backlog)  # its listen() replaces the socket's
            await site.start()
            ready(f"http://{config.gateway.host}:{sock.getsockname()[1]}")
            await stop.wait()
            log.info("shutting down: no new connections")
            await site.stop()
            await end_requests(runner.app[GATEWAY], config.gateway.shutdown_grace_s)
        finally:
            await runner.cleanup()
