"""Minimal OpenAI chat relays, one per HTTP stack, for ``bench/http_stacks.py``.

    python bench/relay_stacks.py --server granian --client pyreqwest --loop uvloop \
        --engines http://127.0.0.1:30001,http://127.0.0.1:30002 --port 0

Every relay does the same work as the gateway's data plane minus the
scheduling: read the POSTed ``/v1/chat/completions`` body, parse it (orjson),
pick the next engine (round robin), forward the re-serialised body, and relay
the answer: the whole JSON body, or, with ``"stream": true``, each SSE chunk as
it arrives. An engine that cannot be reached gets a 502 with an OpenAI error
body. What differs is the stack:

- ``--server``: ``aiohttp-web`` (``web.Application`` with a middleware, routed,
  run by ``web.AppRunner(handler_cancellation=True, access_log=None)``: how
  ``gateway/app.py`` serves), ``aiohttp-lowlevel`` (``aiohttp.web.Server``, one
  handler, no router, no middleware, no access log), ``granian`` (granian's
  Rust HTTP server, RSGI interface, one worker process);
- ``--client``: ``aiohttp-gateway`` (one ``ClientSession`` as
  ``engines/client.py`` builds it), ``aiohttp-tuned`` (no auto-decompression,
  no ``User-Agent``/``Accept-Encoding`` headers, a long keep-alive pool),
  ``pyreqwest`` (Rust ``reqwest``/hyper, its own Tokio runtime thread);
- ``--loop``: ``asyncio`` or ``uvloop`` (granian's ``--loop``).

Prints ``relay ready on PORT`` once it listens, and serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from datetime import timedelta

import orjson

SERVERS = ("aiohttp-web", "aiohttp-lowlevel", "granian")
CLIENTS = ("aiohttp-gateway", "aiohttp-tuned", "pyreqwest")
LOOPS = ("asyncio", "uvloop")
CHAT_PATH = "/v1/chat/completions"
REQUEST_TIMEOUT_S = 600.0
JSON_HEADERS = {"Content-Type": "application/json"}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# granian imports this module in its worker process: the relay's settings come through the environment.
ENV_ENGINES, ENV_CLIENT = "LAPS_RELAY_ENGINES", "LAPS_RELAY_CLIENT"


class EngineDown(Exception):
    """The engine could not be reached or dropped the connection."""


# ---------------------------------------------------------------- clients: post a body, get (status, bytes) or (status, chunks)

class AiohttpClient:
    """An ``aiohttp.ClientSession``: ``tuned`` drops auto-decompression and the default headers, keeps idle
    connections 60 s; otherwise it is built as ``engines/client.py`` builds the gateway's."""

    def __init__(self, tuned: bool) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self._timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, sock_connect=5)
        if tuned:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                                                 auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding"))
        else:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def post(self, url: str, data: bytes) -> tuple[int, bytes]:
        try:
            async with self.session.post(url, data=data, headers=JSON_HEADERS, timeout=self._timeout) as resp:
                return resp.status, await resp.read()
        except (self._aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise EngineDown(repr(err)) from None

    async def stream(self, url: str, data: bytes, start: Callable[[int], Awaitable[None]],
                     send: Callable[[bytes], Awaitable[None]]) -> None:
        try:
            async with self.session.post(url, data=data, headers=JSON_HEADERS, timeout=self._timeout) as resp:
                await start(resp.status)
                async for chunk in resp.content.iter_any():
                    await send(chunk)
        except (self._aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise EngineDown(repr(err)) from None

    async def close(self) -> None:
        await self.session.close()


class PyreqwestClient:
    """A ``pyreqwest`` async client (Rust reqwest on hyper): unlimited pooled keep-alive connections, no
    decompression, the same total timeout."""

    def __init__(self) -> None:
        from pyreqwest.client import ClientBuilder
        from pyreqwest.exceptions import PyreqwestError

        self._error = PyreqwestError
        self.client = (ClientBuilder().max_connections(None).timeout(timedelta(seconds=REQUEST_TIMEOUT_S))
                       .connect_timeout(timedelta(seconds=5)).gzip(False).brotli(False).zstd(False).deflate(False)
                       .build())

    async def post(self, url: str, data: bytes) -> tuple[int, bytes]:
        try:
            resp = await self.client.post(url).headers(JSON_HEADERS).body_bytes(data).build().send()
            return resp.status, bytes(await resp.bytes())
        except self._error as err:
            raise EngineDown(repr(err)) from None

    async def stream(self, url: str, data: bytes, start: Callable[[int], Awaitable[None]],
                     send: Callable[[bytes], Awaitable[None]]) -> None:
        try:
            # No read-ahead: with pyreqwest's default 64 KiB buffer the response only comes once that much of the
            # stream, or all of it, has arrived (engines/client.py does the same).
            async with self.client.post(url).headers(JSON_HEADERS).body_bytes(data).streamed_read_buffer_limit(0).build_streamed() as resp:
                await start(resp.status)
                while (chunk := await resp.body_reader.read_chunk()) is not None:
                    await send(bytes(chunk))
        except self._error as err:
            raise EngineDown(repr(err)) from None

    async def close(self) -> None:
        await self.client.close()


def make_client(kind: str) -> AiohttpClient | PyreqwestClient:
    """The client named ``kind`` (one of :data:`CLIENTS`), created on the running loop."""
    if kind == "pyreqwest":
        return PyreqwestClient()
    return AiohttpClient(tuned=kind == "aiohttp-tuned")


class Relay:
    """The stack-independent part: parse the body, pick the next engine, re-serialise (``body`` dict in,
    ``(url, bytes, stream)`` out)."""

    def __init__(self, engine_urls: list[str], client: AiohttpClient | PyreqwestClient) -> None:
        self._engines = itertools.cycle([url.rstrip("/") + CHAT_PATH for url in engine_urls])
        self.client = client

    def route(self, raw: bytes) -> tuple[str, bytes, bool]:
        """Raises ``orjson.JSONDecodeError`` or ``TypeError`` on a body that is not a JSON object."""
        body = orjson.loads(raw)
        if not isinstance(body, dict):
            raise TypeError("the body must be a JSON object")
        return next(self._engines), orjson.dumps(body), bool(body.get("stream"))


def error_body(status: int, message: str, kind: str) -> bytes:
    """An OpenAI error body."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}})


# ---------------------------------------------------------------- aiohttp servers

async def serve_aiohttp(relay_factory: Callable[[], Relay], lowlevel: bool, port: int) -> None:
    """Serve with aiohttp (``web.Application`` + ``AppRunner`` as the gateway, or the low-level ``web.Server``)
    until SIGINT/SIGTERM."""
    from aiohttp import web

    relay = relay_factory()

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        try:
            url, data, stream = relay.route(await request.read())
        except (orjson.JSONDecodeError, TypeError) as err:
            return web.Response(status=400, body=error_body(400, str(err), "invalid_request_error"), headers=JSON_HEADERS)
        if not stream:
            try:
                status, payload = await relay.client.post(url, data)
            except EngineDown as err:
                return web.Response(status=502, body=error_body(502, str(err), "engine_error"), headers=JSON_HEADERS)
            return web.Response(status=status, body=payload, headers=JSON_HEADERS)
        response = web.StreamResponse(headers=SSE_HEADERS)

        async def start(status: int) -> None:
            response.set_status(status)
            await response.prepare(request)

        try:
            await relay.client.stream(url, data, start, response.write)
        except EngineDown as err:
            if not response.prepared:
                return web.Response(status=502, body=error_body(502, str(err), "engine_error"), headers=JSON_HEADERS)
            await response.write(b"data: " + error_body(502, str(err), "engine_error") + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    if lowlevel:
        server = web.Server(handle, handler_cancellation=True, access_log=None)
        runner: web.BaseRunner = web.ServerRunner(server, shutdown_timeout=1.0)
    else:
        @web.middleware
        async def passthrough(request: web.Request, handler):  # the gateway's error middleware, minus its work
            return await handler(request)

        app = web.Application(middlewares=[passthrough], client_max_size=64 * 1024 * 1024)
        app.router.add_post(CHAT_PATH, handle)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"relay ready on {site._server.sockets[0].getsockname()[1]}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await relay.client.close()


# ---------------------------------------------------------------- granian (RSGI)

class RsgiRelay:
    """The relay as an RSGI application (granian): its client lives on the worker's loop (``__rsgi_init__``)."""

    relay: Relay | None = None

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        async def build() -> Relay:
            return Relay(os.environ[ENV_ENGINES].split(","), make_client(os.environ[ENV_CLIENT]))

        self.relay = loop.run_until_complete(build())

    def __rsgi_del__(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.run_until_complete(self.relay.client.close())

    async def __rsgi__(self, scope, proto) -> None:
        relay = self.relay
        try:
            url, data, stream = relay.route(await proto())
        except (orjson.JSONDecodeError, TypeError) as err:
            proto.response_bytes(400, [("content-type", "application/json")], error_body(400, str(err), "invalid_request_error"))
            return
        if not stream:
            try:
                status, payload = await relay.client.post(url, data)
            except EngineDown as err:
                proto.response_bytes(502, [("content-type", "application/json")], error_body(502, str(err), "engine_error"))
                return
            proto.response_bytes(status, [("content-type", "application/json")], payload)
            return
        transport = None

        async def start(status: int) -> None:
            nonlocal transport
            transport = proto.response_stream(status, [("content-type", "text/event-stream"), ("cache-control", "no-cache")])

        async def send(chunk: bytes) -> None:
            await transport.send_bytes(chunk)

        try:
            await relay.client.stream(url, data, start, send)
        except EngineDown as err:
            if transport is None:
                proto.response_bytes(502, [("content-type", "application/json")], error_body(502, str(err), "engine_error"))
            else:
                await transport.send_bytes(b"data: " + error_body(502, str(err), "engine_error") + b"\n\ndata: [DONE]\n\n")


rsgi_app = RsgiRelay()


def serve_granian(engines: str, client: str, loop: str, port: int) -> None:
    """Serve ``rsgi_app`` with granian (one worker process, one runtime thread, no access log) until SIGINT/SIGTERM."""
    from granian import Granian
    from granian.constants import Interfaces, Loops

    if port == 0:  # granian binds the port itself: pick a free one
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    os.environ[ENV_ENGINES], os.environ[ENV_CLIENT] = engines, client
    server = Granian("bench.relay_stacks:rsgi_app", address="127.0.0.1", port=port, interface=Interfaces.RSGI,
                     workers=1, loop=Loops(loop), log_access=False, log_level="warning")
    print(f"relay ready on {port}", flush=True)  # granian accepts once its worker is up; the caller polls
    server.serve()


def main() -> int:
    from laps.doc_help import doc_parser
    parser = doc_parser(__doc__, split=False)
    parser.add_argument("--server", choices=SERVERS, required=True)
    parser.add_argument("--client", choices=CLIENTS, required=True)
    parser.add_argument("--loop", choices=LOOPS, required=True)
    parser.add_argument("--engines", required=True, help="comma-separated engine base URLs")
    parser.add_argument("--port", type=int, default=0, help="port to listen on, 0: a free one (default: %(default)s)")
    args = parser.parse_args()
    if args.server == "granian":
        serve_granian(args.engines, args.client, args.loop, args.port)
        return 0

    def relay_factory() -> Relay:
        return Relay(args.engines.split(","), make_client(args.client))

    coro = serve_aiohttp(relay_factory, args.server == "aiohttp-lowlevel", args.port)
    if args.loop == "uvloop":
        import uvloop
        uvloop.run(coro)
    else:
        asyncio.run(coro)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
