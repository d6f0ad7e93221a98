"""The engines' HTTP client: every request laps sends to an engine goes through here.

The one module that imports an HTTP client library for engines: a
:mod:`pyreqwest` client (Rust reqwest on hyper, on its own Tokio thread) for
the gateway's lifetime, with pooled keep-alive connections and no limit on
them, no decompression, no proxy from the environment, no redirects, explicit
timeouts. Callers see only :class:`EngineResponse` and :class:`EngineHTTPError`
(:class:`EngineConnectError`, :class:`EngineTimedOut`, :class:`EngineStatusError`).
``bench/http_stacks.py`` (README, Gateway overhead) measured why this client:
20–40% less CPU per relayed non-streaming request than aiohttp's.

With a ``tracer``, each generation request runs in an ``engine call`` CLIENT
span and carries its W3C ``traceparent`` (``gateway/tracing.py``).

Cancellation (the client went away, or :class:`gateway.guard.RequestGuard` cut
the wait off): once the answer's head has come (a stream: SGLang sends it at
once), a cancelled request drops its connection and the engine sees the
disconnect. Before that, pyreqwest 0.15.1 runs the request on to the engine's
answer or the request timeout (``close()`` does not stop it either), so callers
that cancel one send ``/abort_request`` (:meth:`EngineClient.abort`).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import AsyncIterator

import orjson
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from pyreqwest.client import Client, ClientBuilder
from pyreqwest.exceptions import ConnectError, PyreqwestError, RequestTimeoutError
from pyreqwest.request import StreamRequest
from pyreqwest.response import Response

log = logging.getLogger("laps.engines")

JSON_HEADERS = {"Content-Type": "application/json"}
CONNECT_TIMEOUT_S = 5.0


class EngineHTTPError(Exception):
    """The engine could not be reached, broke the connection or answered something unreadable
    (the base of this module's errors; the message says what, from the HTTP library's causes)."""


class EngineConnectError(EngineHTTPError):
    """No connection to the engine (refused, reset while connecting): nothing listens at its URL."""


class EngineTimedOut(EngineHTTPError):
    """The engine did not answer (or finish its body) within the request's timeout."""


class EngineStatusError(EngineHTTPError):
    """The engine answered ``status`` (not 200) where only 200 will do (:meth:`EngineClient.get`)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _raise_if_cancelled(task: asyncio.Task, asked: int) -> None:
    """Raise the cancellation that ``task`` was asked for (more requests than the ``asked`` it had) while it awaited
    pyreqwest: pyreqwest 0.15.1 may complete an awaitable cancelled at the moment its result arrives and drop the
    cancellation (seen: streams that the shutdown's guard had cut off relayed on to their end).

    Raises:
        asyncio.CancelledError: a cancellation was asked for and not delivered.
    """
    if task.cancelling() > asked:
        raise asyncio.CancelledError()


def _engine_error(err: PyreqwestError) -> EngineHTTPError:
    """``err`` as this module's error: its kind, and its message with the innermost cause
    (e.g. ``connection error: Connection refused (os error 111)``)."""
    causes = getattr(err, "details", {}).get("causes") or ()
    message = f"{err.message}: {causes[-1]['message']}" if causes else err.message
    kind = EngineTimedOut if isinstance(err, RequestTimeoutError) else EngineConnectError if isinstance(err, ConnectError) else EngineHTTPError
    return kind(message)


class EngineResponse:
    """An engine's answer: its ``status``; the body whole (:meth:`read`) or as it arrives (:meth:`chunks`)."""

    __slots__ = ("status", "_response")

    def __init__(self, response: Response) -> None:
        self.status = response.status
        self._response = response

    async def read(self) -> bytes:
        """The whole body.

        Raises:
            EngineHTTPError: the connection broke, or the request's timeout passed, before its end.
        """
        try:
            return bytes(await self._response.bytes())
        except PyreqwestError as err:
            raise _engine_error(err) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body chunk by chunk, each as soon as it arrives (of a ``stream=True`` request: an SSE stream
        relayed event by event; sizes are what the socket reads give).

        Raises:
            EngineHTTPError: the connection broke, or the request's timeout passed, before the body's end.
        """
        reader = self._response.body_reader
        task = asyncio.current_task()
        while True:
            asked = task.cancelling()
            try:
                chunk = await reader.read_chunk()
            except PyreqwestError as err:
                raise _engine_error(err) from None
            _raise_if_cancelled(task, asked)
            if chunk is None:
                return
            yield bytes(chunk)


class EngineClient:
    """Talks to SGLang-compatible engines by base URL (``http://host:port``).

    ``request_timeout_s`` bounds a whole generation (connect to the body's
    end); probes and aborts use ``probe_timeout_s``. Every method but
    :meth:`start` needs a started client (:meth:`start` ... :meth:`close`, or ``async with``).
    """

    def __init__(self, request_timeout_s: float = 600.0, probe_timeout_s: float = 2.0, tracer: Tracer | None = None) -> None:
        self._request_timeout = timedelta(seconds=request_timeout_s)
        self._probe_timeout = timedelta(seconds=probe_timeout_s)
        self._tracer = tracer
        self._client: Client | None = None

    async def start(self) -> None:
        self._client = (ClientBuilder().max_connections(None).timeout(self._request_timeout)
                        .connect_timeout(timedelta(seconds=CONNECT_TIMEOUT_S)).gzip(False).brotli(False).zstd(False).deflate(False)
                        .no_proxy().follow_redirects(False).build())

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def __aenter__(self) -> "EngineClient":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def post(self, base_url: str, path: str, body: dict, stream: bool = False, timeout_s: float | None = None) -> "_Exchange":
        """``POST base_url + path`` with a JSON ``body``; use as ``async with ... as response`` (an :class:`EngineResponse`).

        ``stream``: the response comes at the engine's headers, its body read with :meth:`EngineResponse.chunks`
        as it arrives; otherwise it comes with its whole body. ``timeout_s`` replaces the request timeout.

        Raises (on enter):
            EngineHTTPError: the engine cannot be reached or did not answer in time.
        """
        return _Exchange(self, base_url + path, orjson.dumps(body), stream, timeout_s, self._tracer)

    async def get(self, base_url: str, path: str, timeout_s: float | None = None) -> bytes:
        """``GET base_url + path`` within ``timeout_s`` (default: the probe timeout); the response body.

        Raises:
            EngineStatusError: the engine answered other than 200.
            EngineHTTPError: the engine cannot be reached, or did not answer in time (:class:`EngineTimedOut`).
        """
        timeout = self._probe_timeout if timeout_s is None else timedelta(seconds=timeout_s)
        try:
            response = await self._client.get(base_url + path).timeout(timeout).build().send()
            payload = bytes(await response.bytes())
        except PyreqwestError as err:
            raise _engine_error(err) from None
        if response.status != 200:
            raise EngineStatusError(f"GET {path} answered HTTP {response.status}: {payload[:200]!r}", response.status)
        return payload

    async def ready(self, base_url: str) -> str:
        """``GET /ready`` within the probe timeout: ``"ready"`` (200), ``"not_ready"`` (another status or a broken
        answer), ``"timeout"`` (no answer in time: frozen, or too busy) or ``"unreachable"`` (connection refused)."""
        try:
            await self.get(base_url, "/ready")
        except EngineTimedOut:
            return "timeout"
        except EngineConnectError:
            return "unreachable"
        except EngineHTTPError:
            return "not_ready"
        return "ready"

    async def abort(self, base_url: str, rid: str) -> None:
        """``POST /abort_request {"rid"}``: the engine frees the request's slot and KV. Never raises."""
        try:
            response = await (self._client.post(base_url + "/abort_request").headers(JSON_HEADERS)
                              .body_bytes(orjson.dumps({"rid": rid})).timeout(self._probe_timeout).build().send())
            log.info("aborted %s on %s: HTTP %d", rid, base_url, response.status)
        except PyreqwestError as err:
            log.warning("abort of %s on %s failed: %s", rid, base_url, _engine_error(err))


class _Exchange:
    """``async with`` one POST to an engine (see :meth:`EngineClient.post`); with a tracer inside an ``engine call``
    span, its ``traceparent`` sent along."""

    def __init__(self, client: EngineClient, url: str, data: bytes, stream: bool, timeout_s: float | None, tracer: Tracer | None) -> None:
        self._client, self._url, self._data, self._stream, self._timeout_s, self._tracer = client, url, data, stream, timeout_s, tracer
        self._streamed: StreamRequest | None = None
        self._span: Span | None = None

    async def __aenter__(self) -> EngineResponse:
        headers = JSON_HEADERS
        if self._tracer is not None:
            self._span = self._tracer.start_span("engine call", kind=SpanKind.CLIENT,
                                                 attributes={"http.request.method": "POST", "url.full": self._url})
            headers = dict(JSON_HEADERS)
            propagate.inject(headers, context=trace.set_span_in_context(self._span))
        request = self._client._client.post(self._url).headers(headers).body_bytes(self._data)
        if self._timeout_s is not None:
            request = request.timeout(timedelta(seconds=self._timeout_s))
        task = asyncio.current_task()
        asked = task.cancelling()
        try:
            if self._stream:
                # Buffer nothing ahead: with pyreqwest's default (64 KiB) the response would only come once that
                # much of the body, or all of it, had arrived, and a stream would reach the client in one piece.
                self._streamed = request.streamed_read_buffer_limit(0).build_streamed()
                response = await self._streamed.__aenter__()
            else:
                response = await request.build().send()
        except PyreqwestError as err:
            error = _engine_error(err)
            self._end(error)
            raise error from None
        except BaseException as err:
            self._end(err)
            raise
        try:
            _raise_if_cancelled(task, asked)
        except asyncio.CancelledError as err:
            await self.__aexit__(type(err), err, None)
            raise
        if self._span is not None:
            self._span.set_attribute("http.response.status_code", response.status)
        return EngineResponse(response)

    async def __aexit__(self, kind, err, tb) -> None:
        try:
            if self._streamed is not None:
                await self._streamed.__aexit__(kind, err, tb)
        except PyreqwestError as exit_err:
            if err is None:  # else the error already on its way out goes on
                err = _engine_error(exit_err)
                raise err from None
        finally:
            self._end(err)

    def _end(self, err: BaseException | None) -> None:
        if self._span is None:
            return
        if err is not None and not isinstance(err, asyncio.CancelledError):
            self._span.record_exception(err)
            self._span.set_status(Status(StatusCode.ERROR, f"{type(err).__name__}: {err}"))
        self._span.end()
        self._span = None
