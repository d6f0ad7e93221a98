"""engines/client.py against engines served here: its one error type, streams that stream, timeouts, a dropped stream."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from engines.client import EngineClient, EngineConnectError, EngineHTTPError, EngineResponse, EngineStatusError, EngineTimedOut
from engines.manager import free_port


class Engine:
    """An engine whose answers the test paces: ``/sse`` sends one event, waits for :attr:`go`, sends ``[DONE]``."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.gone = asyncio.Event()  # a handler saw its client leave
        self.bodies: list[bytes] = []
        self.ready_slow = False  # /ready waits for go
        self.app = web.Application()
        self.app.router.add_post("/sse", self._sse)
        self.app.router.add_post("/broken", self._broken)
        self.app.router.add_get("/slow", self._slow)
        self.app.router.add_get("/missing", self._missing)
        self.app.router.add_get("/ready", self._ready)
        self.app.router.add_post("/json", self._json)

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.read())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"n": 1}\n\n')
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.gone.set()
            raise
        await response.write(b"data: [DONE]\n\n")
        return response

    async def _broken(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        response.content_length = 1000  # promises more than it sends
        await response.prepare(request)
        await response.write(b'data: {"n": 1}\n\n')
        request.transport.close()
        return response

    async def _ready(self, request: web.Request) -> web.Response:
        if self.ready_slow:
            await self.go.wait()
        return web.Response(text="ok")

    async def _missing(self, request: web.Request) -> web.Response:
        return web.Response(status=404, text="no such route")

    async def _slow(self, request: web.Request) -> web.Response:
        await self.go.wait()
        return web.Response(text="late")

    async def _json(self, request: web.Request) -> web.Response:
        return web.json_response({"got": await request.json(), "type": request.headers["Content-Type"]}, status=201)


@pytest.fixture
async def engine():
    fake = Engine()
    server = TestServer(fake.app, handler_cancellation=True)
    await server.start_server()
    client = EngineClient(request_timeout_s=30.0, probe_timeout_s=0.3)
    await client.start()
    yield fake, client, str(server.make_url("")).rstrip("/")
    fake.go.set()
    await client.close()
    await server.close()


async def test_a_stream_arrives_chunk_by_chunk_before_the_engine_ends_it(engine):
    fake, client, url = engine
    async with client.post(url, "/sse", {"rid": "r1"}, stream=True) as response:
        assert response.status == 200
        chunks = response.chunks()
        # The engine sends [DONE] only after this first event has reached the client: a buffered stream never gets here.
        assert await asyncio.wait_for(anext(chunks), timeout=10) == b'data: {"n": 1}\n\n'
        fake.go.set()
        assert [c async for c in chunks] == [b"data: [DONE]\n\n"]
    assert fake.bodies == [b'{"rid":"r1"}']


async def test_a_json_answer_comes_whole_with_its_status(engine):
    _, client, url = engine
    async with client.post(url, "/json", {"a": [1, 2]}) as response:
        assert (response.status, await response.read()) == (201, b'{"got": {"a": [1, 2]}, "type": "application/json"}')


async def test_a_stream_read_cancelled_drops_the_connection(engine):
    fake, client, url = engine

    async def read() -> None:
        async with client.post(url, "/sse", {}, stream=True) as response:
            async for _ in response.chunks():
                pass

    reading = asyncio.ensure_future(read())
    while not fake.bodies:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the first event is read, the next is awaited
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    await asyncio.wait_for(fake.gone.wait(), timeout=10)  # the engine saw its client leave


async def test_a_body_cut_short_is_an_engine_http_error(engine):
    _, client, url = engine
    with pytest.raises(EngineHTTPError):
        async with client.post(url, "/broken", {}, stream=True) as response:
            async for _ in response.chunks():
                pass


async def test_nothing_listening_is_a_connect_error_and_unreachable():
    client = EngineClient()
    await client.start()
    url = f"http://127.0.0.1:{free_port()}"
    try:
        with pytest.raises(EngineConnectError, match="Connection refused"):
            async with client.post(url, "/v1/chat/completions", {}):
                pass
        with pytest.raises(EngineConnectError):
            await client.get(url, "/v1/loads")
        assert await client.ready(url) == "unreachable"
        await client.abort(url, "r1")  # logged, never raised
    finally:
        await client.close()


async def test_no_answer_in_time_is_a_timeout_for_get_post_and_ready(engine):
    fake, client, url = engine
    assert await client.ready(url) == "ready"
    with pytest.raises(EngineTimedOut):
        await client.get(url, "/slow")  # the probe timeout, 0.3 s
    with pytest.raises(EngineTimedOut):
        await client.get(url, "/slow", timeout_s=0.2)
    with pytest.raises(EngineTimedOut):
        async with client.post(url, "/sse", {}, stream=True, timeout_s=0.3) as response:  # the whole request, body included
            async for _ in response.chunks():
                pass
    fake.ready_slow = True
    assert await client.ready(url) == "timeout"


async def test_a_get_answered_other_than_200_is_a_status_error(engine):
    _, client, url = engine
    with pytest.raises(EngineStatusError, match="GET /missing answered HTTP 404: b'no such route'") as caught:
        await client.get(url, "/missing")
    assert caught.value.status == 404 and isinstance(caught.value, EngineHTTPError)


async def test_a_cancellation_the_http_library_drops_is_raised_after_the_chunk():
    class SwallowingReader:  # as pyreqwest 0.15.1 may do: the awaited chunk arrives, the cancellation is lost
        async def read_chunk(self):
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return b"data: late\n\n"

    got = []

    async def relay() -> None:
        async for chunk in EngineResponse(SimpleNamespace(status=200, body_reader=SwallowingReader())).chunks():
            got.append(chunk)

    task = asyncio.ensure_future(relay())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=5)
    assert got == []
