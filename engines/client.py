"""The SGLang HTTP client: every request the gateway sends to an engine goes through here.

One :class:`aiohttp.ClientSession` for the gateway's lifetime (keep-alive
connection pool, TCP_NODELAY is aiohttp's default), explicit timeouts. With a
``tracer``, each generation request runs in an ``engine call`` CLIENT span and
carries its W3C ``traceparent`` (``gateway/tracing.py``).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

log = logging.getLogger("laps.engines")


class EngineClient:
    """Talks to SGLang-compatible engines by base URL (``http://host:port``).

    ``request_timeout_s`` bounds a whole generation; probes and aborts use a
    short timeout of their own.
    """

    def __init__(self, request_timeout_s: float = 600.0, probe_timeout_s: float = 2.0, tracer: Tracer | None = None) -> None:
        self._request_timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=5)
        self._probe_timeout = aiohttp.ClientTimeout(total=probe_timeout_s)
        self._tracer = tracer
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), json_serialize=lambda o: orjson.dumps(o).decode())

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def post(self, base_url: str, path: str, body: dict) -> "aiohttp.client._RequestContextManager | _TracedPost":
        """``POST base_url + path`` with a JSON ``body``; use as ``async with`` (traced with a tracer).

        Raises (on enter): :class:`aiohttp.ClientError` or :class:`asyncio.TimeoutError`
        when the engine cannot be reached.
        """
        headers = {"Content-Type": "application/json"}
        if self._tracer is not None:
            return _TracedPost(self, self._tracer, base_url + path, orjson.dumps(body), headers)
        return self.session.post(base_url + path, data=orjson.dumps(body), headers=headers, timeout=self._request_timeout)

    async def get(self, base_url: str, path: str) -> bytes:
        """``GET base_url + path`` within the probe timeout; the response body.

        Raises:
            aiohttp.ClientError: the engine cannot be reached, or it answered
                other than 200 (:class:`aiohttp.ClientResponseError`).
            asyncio.TimeoutError: no answer within the probe timeout.
        """
        async with self.session.get(base_url + path, timeout=self._probe_timeout) as resp:
            resp.raise_for_status()
            return await resp.read()

    async def ready(self, base_url: str) -> str:
        """``GET /ready`` within the probe timeout: ``"ready"`` (200), ``"not_ready"`` (another status or a broken
        answer), ``"timeout"`` (no answer in time: frozen, or too busy) or ``"unreachable"`` (connection refused)."""
        try:
            async with self.session.get(base_url + "/ready", timeout=self._probe_timeout) as resp:
                return "ready" if resp.status == 200 else "not_ready"
        except asyncio.TimeoutError:
            return "timeout"
        except aiohttp.ClientConnectorError:
            return "unreachable"
        except aiohttp.ClientError:
            return "not_ready"

    async def abort(self, base_url: str, rid: str) -> None:
        """``POST /abort_request {"rid"}``: the engine frees the request's slot and KV. Never raises."""
        try:
            async with self.session.post(base_url + "/abort_request", json={"rid": rid}, timeout=self._probe_timeout) as resp:
                log.info("aborted %s on %s: HTTP %d", rid, base_url, resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            log.warning("abort of %s on %s failed: %r", rid, base_url, err)


class _TracedPost:
    """``async with`` one engine request inside an ``engine call`` span, its ``traceparent`` sent along."""

    def __init__(self, client: EngineClient, tracer: Tracer, url: str, data: bytes, headers: dict[str, str]) -> None:
        self._client, self._tracer, self._url, self._data, self._headers = client, tracer, url, data, headers
        self._request: aiohttp.client._RequestContextManager | None = None

    async def __aenter__(self) -> aiohttp.ClientResponse:
        self._span = self._tracer.start_span("engine call", kind=SpanKind.CLIENT,
                                             attributes={"http.request.method": "POST", "url.full": self._url})
        propagate.inject(self._headers, context=trace.set_span_in_context(self._span))
        self._request = self._client.session.post(self._url, data=self._data, headers=self._headers,
                                                  timeout=self._client._request_timeout)
        try:
            response = await self._request.__aenter__()
        except BaseException as err:
            self._end(err)
            raise
        self._span.set_attribute("http.response.status_code", response.status)
        return response

    async def __aexit__(self, kind, err, tb) -> bool | None:
        try:
            return await self._request.__aexit__(kind, err, tb)
        finally:
            self._end(err)

    def _end(self, err: BaseException | None) -> None:
        if err is not None and not isinstance(err, asyncio.CancelledError):
            self._span.record_exception(err)
            self._span.set_status(Status(StatusCode.ERROR, f"{type(err).__name__}: {err}"))
        self._span.end()
