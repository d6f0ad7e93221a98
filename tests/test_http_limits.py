"""The gateway's HTTP server against slow and oversized clients, served as `laps serve` serves it
(:func:`gateway.app.app_runner` on a listening socket): a connection without a whole request head for
``gateway.keepalive_timeout_s`` is closed, a body slower than ``gateway.body_timeout_s`` gets 408, a body over
``MAX_BODY_BYTES`` gets 413, all as OpenAI error bodies where an answer is possible; replies slower than both
limits, streamed or not, are not cut."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import gzip
import logging
import shutil
import subprocess
import zlib

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.app import MAX_BODY_BYTES, app_runner, create_app, listen_socket, serve_until
from gateway.content_encoding import MAX_GZIP_MEMBERS
from gateway.state import GATEWAY
from laps.config import load_config
from tests.fake_engine import FakeEngine
from tests.test_gateway import chat, with_gateway

LIMIT_S = 0.2  # the limit a test is about; the slow replies take 5 times as long
SLOW_REPLY_S = 5 * LIMIT_S
CLOSE_WAIT_S = 30.0  # far over LIMIT_S: a connection still open then was not closed by the limit
UNUSED_LIMIT_S = 60.0  # a limit a test is not about: far over what a stalled test loop might take to send a head
HEAD_LIMIT = {"keepalive_timeout_s": LIMIT_S}
BODY_LIMIT = {"body_timeout_s": LIMIT_S}


@pytest.fixture
async def gateway(request):
    """Two fake engines behind the gateway's app runner on a free loopback port, with ``gateway.keepalive_timeout_s``
    and ``gateway.body_timeout_s`` of ``UNUSED_LIMIT_S`` unless an indirect parameter (a dict) sets them (the test
    that is about a limit sets it to ``LIMIT_S``; a 0.2-s head limit on a test that is not would close the
    connection whenever the shared event loop stalls that long between the connect and the head); yields
    (port, fake engines by name)."""
    limits = {"keepalive_timeout_s": UNUSED_LIMIT_S, "body_timeout_s": UNUSED_LIMIT_S} | getattr(request, "param", {})
    fakes = {"sp0": FakeEngine("sp0"), "lp0": FakeEngine("lp0")}
    servers = {name: TestServer(f.app) for name, f in fakes.items()}
    for s in servers.values():
        await s.start_server()
    config = with_gateway(load_config(), **limits)
    runner = app_runner(config, create_app(config, engine_urls={name: str(s.make_url("")).rstrip("/") for name, s in servers.items()}))
    await runner.setup()
    sock = listen_socket("127.0.0.1", 0)
    try:
        await web.SockSite(runner, sock).start()
        yield sock.getsockname()[1], fakes
    finally:
        await runner.cleanup()
        sock.close()
        for s in servers.values():
            await s.close()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body: (status, headers with lower-case names, body)."""
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CLOSE_WAIT_S)).decode()
    status_line, *lines = head.rstrip("\r\n").split("\r\n")
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in lines)}
    return int(status_line.split()[1]), headers, await reader.readexactly(int(headers["content-length"]))


async def closed_by_the_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection (end of stream) within ``CLOSE_WAIT_S``, reading what it sends."""
    with contextlib.suppress(ConnectionError):
        try:
            while await asyncio.wait_for(reader.read(65536), CLOSE_WAIT_S):
                pass
        except TimeoutError:
            return False
    return True


@pytest.mark.parametrize("gateway", [HEAD_LIMIT], indirect=True, ids=["head-limit"])
async def test_a_client_sending_its_headers_a_byte_at_a_time_is_cut_off(gateway):
    port, fakes = gateway
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: laps\r\nX-Slow: ")

    async def dribble() -> None:  # a byte every quarter of the limit: bytes arriving do not restart it
        with contextlib.suppress(ConnectionError):
            while True:
                writer.write(b"a")
                await writer.drain()
                await asyncio.sleep(LIMIT_S / 4)

    task = asyncio.ensure_future(dribble())
    try:
        assert await closed_by_the_server(reader)
    finally:
        task.cancel()
        writer.close()
    assert fakes["sp0"].bodies == fakes["lp0"].bodies == []


@pytest.mark.parametrize("gateway", [HEAD_LIMIT], indirect=True, ids=["head-limit"])
async def test_an_idle_keep_alive_connection_is_closed_after_its_answer(gateway):
    port, _ = gateway
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: laps\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert (status, orjson.loads(body)["status"]) == (200, "ok") and headers.get("connection") != "close"  # kept alive
    assert await closed_by_the_server(reader)  # then closed, having sent nothing more
    writer.close()


@pytest.mark.parametrize("gateway", [BODY_LIMIT], indirect=True, ids=["body-limit"])
async def test_a_body_that_stops_arriving_gets_an_openai_408_and_the_connection_closes(gateway):
    port, fakes = gateway
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: laps\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                 b'{"model": ')  # 10 of the 100 bytes, then nothing
    status, headers, body = await read_response(reader)
    writer.close()
    assert (status, headers["connection"]) == (408, "close")
    assert orjson.loads(body) == {"error": {"message": f"the request body did not arrive within {LIMIT_S:g} s (gateway.body_timeout_s)",
                                            "type": "invalid_request_error", "param": None, "code": "request_timeout"}}
    assert fakes["sp0"].bodies == fakes["lp0"].bodies == []


@pytest.mark.parametrize("gateway", [HEAD_LIMIT | BODY_LIMIT], indirect=True, ids=["both-limits"])
@pytest.mark.parametrize("stream", [True, False])
async def test_replies_slower_than_the_limits_are_not_cut(gateway, stream):
    """The engine holds the reply (a stream after its first chunk, an answer before it) for 5 times both limits,
    then finishes it: the client gets all of it."""
    port, fakes = gateway
    engine = fakes["sp0"]
    engine.hold_streams, engine.hold_answers = stream, not stream

    async def ask(session: aiohttp.ClientSession) -> str:
        async with session.post("/v1/chat/completions", json=chat("Hi", stream=stream)) as resp:
            assert resp.status == 200
            return (await resp.read()).decode()

    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
        reply = asyncio.ensure_future(ask(session))
        await asyncio.sleep(SLOW_REPLY_S)
        assert not reply.done()  # still held by the engine
        (engine.release if stream else engine.answer).set()
        text = await reply
    if stream:
        events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
        assert "hi from sp0" in events[0] and events[-1] == "[DONE]"
        assert orjson.loads(events[-2])["choices"][0]["finish_reason"] == "stop"
    else:
        assert orjson.loads(text)["choices"][0]["message"]["content"] == "hi from sp0"


async def test_a_declared_body_over_the_limit_gets_an_openai_413_before_it_is_read(gateway):
    port, fakes = gateway
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: laps\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1))  # and no byte of the body
    status, headers, body = await read_response(reader)
    writer.close()
    assert (status, headers["connection"]) == (413, "close")
    assert orjson.loads(body) == {"error": {
        "message": f"request body of {MAX_BODY_BYTES + 1} bytes (Content-Length) is over the gateway's limit of {MAX_BODY_BYTES} bytes (64 MiB)",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}}
    assert fakes["sp0"].bodies == fakes["lp0"].bodies == []


async def test_a_chunked_body_over_the_limit_gets_an_openai_413(gateway):
    port, _ = gateway
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: laps\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (2**20, b" " * 2**20)
    for _ in range(MAX_BODY_BYTES // 2**20):
        writer.write(chunk)
        await writer.drain()
    writer.write(b"1\r\n \r\n0\r\n\r\n")  # one byte over
    await writer.drain()
    status, headers, body = await read_response(reader)
    writer.close()
    assert (status, headers["connection"]) == (413, "close")
    assert orjson.loads(body)["error"] == {"message": f"request body is over the gateway's limit of {MAX_BODY_BYTES} bytes (64 MiB)",
                                           "type": "invalid_request_error", "param": None, "code": "request_too_large"}


CHAT = orjson.dumps(chat("Hi"))
DEFLATE = zlib.compressobj(wbits=-zlib.MAX_WBITS)  # raw deflate, as some clients send it
RAW_DEFLATE = DEFLATE.compress(CHAT) + DEFLATE.flush()
BOMB = gzip.compress(b" " * (MAX_BODY_BYTES + 1))  # ~65 KB that decode to one byte over the limit


@pytest.mark.parametrize("encoding, body, status, error", [
    ("gzip", gzip.compress(CHAT), 200, None),
    ("Deflate", zlib.compress(CHAT), 200, None),
    ("deflate", RAW_DEFLATE, 200, None),
    ("identity", CHAT, 200, None),
    ("gzip", CHAT, 400, "request body is not valid gzip data (Content-Encoding: gzip): Error -3 while decompressing data: incorrect header check"),
    ("gzip", gzip.compress(CHAT)[:-12], 400, "request body is not valid gzip data (Content-Encoding: gzip): the compressed data ends early"),
    ("br", CHAT, 415, "Content-Encoding 'br' is not supported: send the body as it is, or as one of gzip, deflate"),
    ("gzip, gzip", gzip.compress(gzip.compress(CHAT)), 415, "Content-Encoding 'gzip, gzip' is not supported: send the body as it is, or as one of gzip, deflate"),
    ("gzip", BOMB, 413, f"request body is over the gateway's limit of {MAX_BODY_BYTES} bytes (64 MiB)"),
    ("x-gzip", gzip.compress(CHAT[:10]) + gzip.compress(CHAT[10:]), 200, None),  # two members, the x- alias
    ("gzip", gzip.compress(CHAT) + b"junk", 400, "request body is not valid gzip data (Content-Encoding: gzip): Error -3 while decompressing data: incorrect header check"),
    ("deflate", zlib.compress(CHAT) + b"junk", 400, "request body is not valid deflate data (Content-Encoding: deflate): 4 bytes follow the end of the compressed data"),
    ("gzip", b"", 400, "request body is not valid gzip data (Content-Encoding: gzip): the compressed data ends early"),
    ("gzip", gzip.compress(b"") * MAX_GZIP_MEMBERS + gzip.compress(CHAT), 400,  # each member costs CPU, however small
     f"request body is not valid gzip data (Content-Encoding: gzip): more than {MAX_GZIP_MEMBERS} gzip members"),
], ids=["gzip", "deflate", "raw-deflate", "identity", "not-gzip", "cut-gzip", "br", "two-codings", "gzip-bomb", "two-members",
        "gzip-then-junk", "deflate-then-junk", "empty", "too-many-members"])
async def test_an_encoded_body_is_decoded_or_refused_with_an_openai_error_never_a_500(gateway, caplog, encoding, body, status, error):
    port, fakes = gateway
    caplog.set_level(logging.INFO)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json", "Content-Encoding": encoding}) as resp:
            answer = await resp.json()
    assert resp.status == status
    if error is None:
        assert answer["choices"][0]["message"]["content"].startswith("hi from")
    else:
        assert answer["error"]["message"] == error and answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["param"] == (None if status == 413 else "Content-Encoding")
        assert fakes["sp0"].bodies == fakes["lp0"].bodies == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no traceback, no "Unhandled exception"


MANY_HEADERS = b"".join(b"X-H%d: 1\r\n" % i for i in range(129))


@pytest.mark.parametrize("first, request_bytes, logged", [
    (None, b"GET /health HTTP/1.1\r\nHost: laps\r\nX-Big: " + b"a" * 8191 + b"\r\n\r\n",
     "LineTooLong: Got more than 8190 bytes when reading: b'aaaa"),
    (None, b"GET /health HTTP/1.1\r\nHost: laps\r\n" + MANY_HEADERS + b"\r\n", "BadHttpMessage: Too many headers received"),
    (None, b"POST /v1/chat/completions HTTP/1.1\r\nHost: laps\r\nContent-Length: abc\r\n\r\n",
     "BadHttpMessage: Invalid character in Content-Length: b'Content-Length: abc'"),
    (None, b"POST /v1/chat/completions HTTP/1.1\r\nHost: laps\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
     "BadHttpMessage: Transfer-Encoding can't be present with Content-Length: b'Transfer-Encoding: chunked'"),
    (b"GET /health HTTP/1.1\r\nHost: laps\r\n\r\n", b"G@T /health HTTP/1.1\r\nHost: laps\r\n\r\n",  # aiohttp logs a first one at DEBUG
     "BadHttpMethod: Invalid method encountered: b'G@T /health HTTP/1.1'"),
], ids=["header-line-over-8190-bytes", "over-128-headers", "bad-content-length", "content-length-and-transfer-encoding",
        "bad-method-on-a-second-request"])
async def test_a_malformed_request_gets_aiohttps_400_and_one_info_line_without_a_traceback(gateway, caplog, first, request_bytes, logged):
    port, fakes = gateway
    caplog.set_level(logging.INFO)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if first is not None:  # a good request first: the connection is an established one
        writer.write(first)
        assert (await read_response(reader))[0] == 200
    writer.write(request_bytes)
    status, headers, _ = await read_response(reader)
    assert (status, headers["content-type"]) == (400, "text/plain; charset=utf-8")
    assert await closed_by_the_server(reader)
    writer.close()
    lines = [(r.levelno, r.exc_info, r.getMessage()) for r in caplog.records if r.name == "aiohttp.server"]
    assert len(lines) == 1 and lines[0][:2] == (logging.INFO, None), lines
    assert lines[0][2].startswith(f"malformed HTTP request from 127.0.0.1 (answered 400): {logged}")
    assert "\n" not in lines[0][2]
    assert fakes["sp0"].bodies == fakes["lp0"].bodies == []


async def test_expect_100_continue_with_a_declared_body_over_the_limit_gets_the_413_without_the_100(gateway):
    port, fakes = gateway
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: laps\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
                 b"Content-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1))
    status, headers, body = await read_response(reader)
    writer.close()
    assert (status, headers["connection"], orjson.loads(body)["error"]["code"]) == (413, "close", "request_too_large")
    assert fakes["sp0"].bodies == fakes["lp0"].bodies == []


async def test_expect_100_continue_with_a_body_within_the_limit_gets_the_100_then_the_answer(gateway):
    port, fakes = gateway
    body = orjson.dumps(chat("Hi"))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: laps\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body))
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CLOSE_WAIT_S) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(body)
    status, _, answer = await read_response(reader)
    writer.close()
    assert (status, orjson.loads(answer)["choices"][0]["message"]["content"]) == (200, "hi from sp0")


def listen_backlogs(port: int) -> list[int]:
    """The backlog of every socket listening on TCP ``port`` (``ss``'s Send-Q of a listening socket: the kernel's
    ``sk_max_ack_backlog``, the ``listen()`` backlog capped at ``net.core.somaxconn``); skips the test without ``ss``."""
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2) to read a listening socket's backlog")
    lines = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout.splitlines()
    return [int(line.split()[2]) for line in lines]


async def test_serve_until_listens_with_gateway_listen_backlog_and_a_frozen_heap():
    """aiohttp's site calls listen() again (its own default backlog is 128): what the kernel keeps is the config's.
    By then the start-up heap is out of the garbage collector's passes (laps.heap)."""
    fakes = {"sp0": FakeEngine("sp0"), "lp0": FakeEngine("lp0")}
    servers = {name: TestServer(f.app) for name, f in fakes.items()}
    for s in servers.values():
        await s.start_server()
    config = with_gateway(load_config(), port=0, listen_backlog=777)  # under Linux's default somaxconn, 4096
    runner = app_runner(config, create_app(config, engine_urls={name: str(s.make_url("")).rstrip("/") for name, s in servers.items()}))
    stop = asyncio.Event()
    backlogs, seen_by_collector = [], []

    def ready(url: str) -> None:
        backlogs.append(listen_backlogs(int(url.rsplit(":", 1)[1])))
        gateway = runner.app[GATEWAY]  # built by the start-up: frozen with it
        seen_by_collector.append(any(o is gateway for o in gc.get_objects()))
        stop.set()

    gc.unfreeze()
    try:
        await serve_until(config, runner, listen_socket("127.0.0.1", 0, backlog=config.gateway.listen_backlog), stop, ready)
    finally:
        gc.unfreeze()  # pytest's heap goes back to the collector
        for s in servers.values():
            await s.close()
    assert backlogs == [[777]]
    assert seen_by_collector == [False]


def test_listen_socket_listens_with_the_backlog_given():
    with listen_socket("127.0.0.1", 0, backlog=333) as sock:
        assert listen_backlogs(sock.getsockname()[1]) == [333]
    with listen_socket("127.0.0.1", 0) as sock:
        assert listen_backlogs(sock.getsockname()[1]) == [2048]  # gateway.listen_backlog's default
