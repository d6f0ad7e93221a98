"""Relaying an engine's answer to the client: the pieces every dispatch path shares.

Used by :mod:`gateway.handlers` (one engine) and :mod:`gateway.pd_dispatch`
(a prefill–decode pair):

* :class:`Reply` and :class:`StreamTap` read what the gateway learns from an
  answer (its text, the engine's reported ``cached_tokens``) while the bytes
  pass through;
* :func:`upstream_error` turns an engine's error answer into an OpenAI error
  (:class:`~gateway.errors.EngineUnavailable` one that broke);
  :func:`error_event` is an error once a stream has started;
* :class:`SSERelay` relays an engine's SSE stream to the client under the
  request's :class:`~gateway.guard.RequestGuard`, and ends it with an error
  event and ``[DONE]`` when the engine fails; :func:`start_stream`,
  :func:`write` and :func:`end_stream` write an SSE stream to the client;
  :class:`ClientGone` says the client left;
* :func:`in_background` / :func:`settle_background` run the work that
  outlives a handler (aborts, prefix-index updates, the bookkeeping of a
  request whose client left after its whole answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Coroutine

import orjson
from aiohttp import web

from engines.client import EngineTimedOut
from gateway.errors import AnswerTooLong, APIError, EngineUnavailable
from gateway.guard import RequestGuard
from gateway.health import back_in_service
from gateway.registry import EngineState
from gateway.state import Gateway

log = logging.getLogger("laps.gateway")

# Aborts and prefix-index updates outlive the handler that starts them; keep them referenced until done.
_background: set[asyncio.Task] = set()


def in_background(work: Coroutine[Any, Any, Any] | asyncio.Future) -> asyncio.Future:
    """Run ``work`` (a coroutine, or a task already running) on the running loop to its end, even if the handler
    that started it is cancelled; the task.

    Raises:
        RuntimeError: no event loop is running.
    """
    task = asyncio.ensure_future(work)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


async def settle_background() -> None:
    """Wait until the background work started so far (aborts, prefix-index updates) is done; its errors are dropped."""
    while _background:
        await asyncio.gather(*list(_background), return_exceptions=True)


def dumps(obj: Any) -> str:
    """``obj`` as compact JSON text (orjson), for ``web.json_response(dumps=...)`` and SSE events."""
    return orjson.dumps(obj).decode()


class ClientGone(Exception):
    """The client closed the connection while the gateway was writing to it."""


def unreachable(engine: EngineState, err: BaseException) -> EngineUnavailable:
    """The client's error for ``engine`` failing with the connection error ``err`` (which, and where, goes to the log).
    A request whose whole time at the engine passed ``gateway.request_timeout_s`` (:class:`EngineTimedOut`) gets an
    :class:`AnswerTooLong`: a long generation on a busy engine is no dead engine."""
    if isinstance(err, EngineTimedOut):
        return AnswerTooLong(engine)
    return EngineUnavailable(engine, f"{engine.url}: {type(err).__name__}: {str(err) or type(err).__name__}")


@dataclass
class Reply:
    """What the gateway learns from an engine's answer: the text it produced (pieces, in order), its reported
    prompt cache hit (``cached_tokens``, tokens; ``None`` until the engine reports it), and whether the client
    has been handed the whole answer (``done``: a stream's ``data: [DONE]`` was relayed, or the whole JSON body was sent);
    ``prompt_observed``: the prefix index has taken the engine's report on the prompt already (a JSON answer's, or in
    PD the prefill engine's answer), so what is learnt from the reply afterwards only inserts; ``finish_reason``: the
    first choice's, once the engine gives one (``"abort"``: SGLang ended the request without an error status, as it
    does for an ``/abort_request``)."""

    text: list[str] = field(default_factory=list)
    cached_tokens: int | None = None
    done: bool = False
    prompt_observed: bool = False
    finish_reason: str | None = None

    def take(self, obj: dict) -> None:
        """Read one OpenAI response object or stream chunk (``choices[].message|delta.content`` or
        ``choices[].text`` and ``finish_reason`` of the first choice, ``index`` 0, when ``n`` > 1;
        ``usage.prompt_tokens_details.cached_tokens``)."""
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if isinstance(choice.get("finish_reason"), str):
                self.finish_reason = choice["finish_reason"]
            message = choice.get("delta") or choice.get("message") or {}
            piece = message.get("content") if isinstance(message, dict) else None
            piece = piece if piece is not None else choice.get("text")
            if isinstance(piece, str):
                self.text.append(piece)
        details = (obj.get("usage") or {}).get("prompt_tokens_details") or {}
        if isinstance(details.get("cached_tokens"), int):
            self.cached_tokens = details["cached_tokens"]


class StreamTap:
    """Splits the relayed SSE bytes into events, reads them into a :class:`Reply` (``data: [DONE]`` sets
    :attr:`Reply.done`: the events fed so far are the whole answer), and drops the usage-only event when only
    the gateway asked for usage (``drop_usage``).

    An event that is not SSE ``data:`` JSON (nor ``[DONE]``, a comment or an SSE field) is a broken stream:
    :attr:`malformed` holds it and it goes no further. ``cached_tokens``: when set, the value the usage's
    ``prompt_tokens_details.cached_tokens`` is rewritten to (a PD answer reports the prefill engine's).
    """

    def __init__(self, reply: Reply, drop_usage: bool, cached_tokens: Callable[[], int | None] | None = None) -> None:
        self.reply = reply
        self.drop_usage = drop_usage
        self.malformed: bytes | None = None
        self.engine_error = False  # the engine ended the stream with its own error event
        self._cached_tokens = cached_tokens
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """The complete events in ``pending + chunk`` that go on to the client (``chunk`` itself, uncopied,
        when it holds whole events and none is dropped)."""
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n\n") + 2
        if end < 2:  # no complete event yet
            self._pending = data
            return b""
        self._pending = data[end:]
        events = data[:end].split(b"\n\n")[:-1]
        kept = []
        changed = False
        for event in events:
            if event.startswith(b"data: {"):
                try:
                    obj = orjson.loads(event[6:])
                except orjson.JSONDecodeError:
                    obj = None
                if not isinstance(obj, dict):
                    self.malformed = event
                    break
                self.reply.take(obj)
                if "error" in obj:
                    self.engine_error = True
                usage = obj.get("usage")
                if usage and not obj.get("choices"):
                    if self.drop_usage:
                        changed = True
                        continue
                    cached = self._cached_tokens() if self._cached_tokens is not None else None
                    if cached is not None and isinstance(usage, dict):
                        event = b"data: " + orjson.dumps({**obj, "usage": with_cached_tokens(usage, cached)})
                        changed = True
            elif event == b"data: [DONE]":
                self.reply.done = True
            elif not event.startswith((b":", b"event:", b"id:", b"retry:")) and event.strip():
                self.malformed = event
                break
            kept.append(event)
        if not changed and len(kept) == len(events):
            return data if end == len(data) else data[:end]
        return b"".join(event + b"\n\n" for event in kept)

    def flush(self) -> bytes:
        """Bytes left after the last complete event (forwarded as they are)."""
        rest, self._pending = self._pending, b""
        return rest


def with_cached_tokens(usage: dict, cached_tokens: int) -> dict:
    """An OpenAI ``usage`` object with ``prompt_tokens_details.cached_tokens`` set to ``cached_tokens``."""
    return {**usage, "prompt_tokens_details": {**(usage.get("prompt_tokens_details") or {}), "cached_tokens": cached_tokens}}


def ask_engine_for_usage(body: dict) -> bool:
    """Set ``stream_options.include_usage`` in a streaming request ``body`` (the engine's ``cached_tokens``
    corrects the prefix index); whether the client itself asked for usage (then its usage event is kept)."""
    options = body.get("stream_options")
    client_wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return client_wants_usage


def upstream_error(engine_id: str, status: int, payload: bytes, headers: dict) -> web.Response:
    """Engine ``engine_id``'s non-200 answer (HTTP ``status``, body ``payload``) in OpenAI's error shape, with ``headers``.

    SGLang 0.5.23 answers OpenAI routes with a flat ``{"object": "error", "message",
    "type": "BadRequestError", "param", "code": 400}``; clients expect OpenAI's
    ``{"error": {"message", "type", "param", "code"}}``: the message and param are kept,
    the type becomes ``invalid_request_error`` (a 4xx) or ``engine_error`` (a 5xx), and
    the code is kept only when it is a string (OpenAI's codes are; SGLang's is the
    status). A body already in OpenAI's shape goes on as it is. A 4xx body that is
    neither becomes the message (first 1000 characters), type ``invalid_request_error``;
    a 5xx body that is neither (a crash page, a traceback) is not meant for clients: the
    client gets HTTP 502 naming the engine only, the body goes to the log.
    """
    error = error_of_answer(engine_id, status, payload)
    error.headers.update(headers)
    return error.response()


def error_of_answer(engine_id: str, status: int, payload: bytes) -> APIError:
    """Engine ``engine_id``'s non-200 answer as the client's :class:`APIError` (see :func:`upstream_error`)."""
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        body = None
    kind = "invalid_request_error" if status < 500 else "engine_error"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):  # OpenAI's shape already
        error = body["error"]
        kind = error.get("type") or kind
    elif isinstance(body, dict) and "message" in body:  # SGLang's flat shape
        error = body
    elif status >= 500:  # not an error the engine meant for a client (a crash page, a traceback): to the log only
        log.warning("engine %s answered HTTP %d: %s", engine_id, status, payload[:1000].decode(errors="replace"))
        return APIError(502, f"engine {engine_id} failed (HTTP {status}); retry later", type="engine_error", code="engine_failed")
    else:
        error = {"message": payload.decode(errors="replace")[:1000] or f"engine answered HTTP {status}"}
    code = error.get("code")
    return APIError(status, str(error.get("message")), type=kind, param=error.get("param"), code=code if isinstance(code, str) else None)


def error_event(api_error: APIError) -> bytes:
    """``api_error`` as the in-stream SSE error event, followed by ``data: [DONE]`` (the stream's last bytes)."""
    return f"data: {dumps(api_error.body())}\n\ndata: [DONE]\n\n".encode()


async def start_stream(request: web.Request, headers: dict) -> web.StreamResponse:
    """Send the client the headers of an SSE response (``headers`` plus the event-stream ones); the response."""
    response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def write(response: web.StreamResponse, data: bytes) -> None:
    """Write ``data`` to the client.

    Raises:
        ClientGone: the client closed the connection.
    """
    try:
        await response.write(data)
    except ConnectionResetError:
        raise ClientGone() from None


async def send_now(request: web.Request, response: web.Response) -> None:
    """Send the whole of ``response`` (headers and body) to the client now, before the handler returns it.

    Raises:
        ClientGone: the client closed the connection.
    """
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionResetError:
        raise ClientGone() from None


async def end_stream(response: web.StreamResponse) -> None:
    """End the stream; a client that already left after the last event has everything it needs."""
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()


class SSERelay:
    """Relays one engine's SSE stream to the client (see :meth:`pump`) and ends it (:meth:`finish`, :meth:`fail`).

    The client's stream starts with the engine's first bytes (its headers are ``headers``), so until then
    (:attr:`response` ``None``) a failure can still be an HTTP error or a retry elsewhere. ``on_first()`` runs
    at the first bytes (TTFT, prefix index, the scheduler's first token).
    """

    def __init__(self, request: web.Request, gw: Gateway, headers: dict, tap: StreamTap, guard: RequestGuard, engine: EngineState,
                 on_first: Callable[[], None]) -> None:
        self.request, self.gw, self.headers, self.tap, self.guard, self.engine = request, gw, headers, tap, guard, engine
        self.on_first = on_first
        self.response: web.StreamResponse | None = None

    async def pump(self, chunks: AsyncIterator[bytes]) -> None:
        """Relay an engine's streamed body (``chunks``, :meth:`engines.client.EngineResponse.chunks`) event by event, under the
        guard's limits.

        Raises:
            EngineUnavailable: the engine sent an event that is not SSE JSON, or ended without ``data: [DONE]``.
            ClientGone: the client left.
        """
        guard, engine, tap = self.guard, self.engine, self.tap
        try:
            async for chunk in chunks:
                data = tap.feed(chunk)
                if tap.malformed is not None:
                    raise EngineUnavailable(engine, f"malformed SSE event {tap.malformed[:200]!r}")
                guard.paused = True
                if self.response is None:
                    self.on_first()
                    engine.open_streams += 1
                    self.response = await start_stream(self.request, self.headers)
                    guard.started()
                if data:
                    await write(self.response, data)
                guard.paused = False
                guard.progress()
                if engine.stalled:
                    back_in_service(self.gw, engine, "its stream brought bytes again")
        finally:
            guard.paused = False
            if self.response is not None:
                engine.open_streams -= 1
        if not tap.reply.done:
            raise EngineUnavailable(engine, f"stream ended without data: [DONE] (last bytes {tap.flush()[-200:]!r})")

    async def finish(self) -> web.StreamResponse:
        """The engine's stream ended with ``[DONE]``: relay what is left and end the client's stream."""
        rest = self.tap.flush()
        if rest:
            await write(self.response, rest)
        await end_stream(self.response)
        return self.response

    async def fail(self, api_error: APIError) -> web.StreamResponse:
        """End the client's started stream with ``api_error``'s event and ``[DONE]`` (a partial event is dropped)."""
        self.tap.flush()
        await write(self.response, error_event(api_error))
        await end_stream(self.response)
        return self.response
