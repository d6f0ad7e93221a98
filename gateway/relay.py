"""Relaying an engine's answer to the client: the pieces every dispatch path shares.

Used by :mod:`gateway.handlers` (one engine) and :mod:`gateway.pd_dispatch`
(a prefill–decode pair):

* :class:`Reply` and :class:`StreamTap` read what the gateway learns from an
  answer (its text, the engine's reported ``cached_tokens``) while the bytes
  pass through;
* :func:`upstream_error` and :class:`EngineUnavailable` turn an engine's
  failure into an OpenAI error; :func:`error_event` is that error once a
  stream has started;
* :func:`start_stream`, :func:`write` and :func:`end_stream` write an SSE
  stream to the client; :class:`ClientGone` says the client left;
* :func:`in_background` / :func:`settle_background` run the work that
  outlives a handler (aborts, prefix-index updates, the bookkeeping of a
  request whose client left after its whole answer).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, Coroutine

import orjson
from aiohttp import web

from gateway.errors import APIError

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


class EngineUnavailable(APIError):
    """An engine could not be reached or dropped the connection (HTTP 502); ``engine_id`` names it."""

    def __init__(self, engine_id: str, engine_url: str, err: BaseException) -> None:
        super().__init__(502, f"engine {engine_id} at {engine_url} failed: {str(err) or type(err).__name__}", type="engine_error", code="engine_unavailable")
        self.engine_id = engine_id


@dataclass
class Reply:
    """What the gateway learns from an engine's answer: the text it produced (pieces, in order), its reported
    prompt cache hit (``cached_tokens``, tokens; ``None`` until the engine reports it), and whether the client
    has been handed the whole answer (``done``: a stream's ``data: [DONE]`` was relayed, or the whole JSON body was sent)."""

    text: list[str] = field(default_factory=list)
    cached_tokens: int | None = None
    done: bool = False

    def take(self, obj: dict) -> None:
        """Read one OpenAI response object or stream chunk (``choices[].message|delta.content`` or
        ``choices[].text``; ``usage.prompt_tokens_details.cached_tokens``)."""
        for choice in obj.get("choices") or ():
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
    the gateway asked for usage (``drop_usage``)."""

    def __init__(self, reply: Reply, drop_usage: bool) -> None:
        self.reply = reply
        self.drop_usage = drop_usage
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
        for event in events:
            if event.startswith(b"data: {"):
                try:
                    obj = orjson.loads(event[6:])
                except orjson.JSONDecodeError:
                    obj = None
                if isinstance(obj, dict):
                    self.reply.take(obj)
                    if self.drop_usage and obj.get("usage") and not obj.get("choices"):
                        continue
            elif event == b"data: [DONE]":
                self.reply.done = True
            kept.append(event)
        if len(kept) == len(events):
            return data if end == len(data) else data[:end]
        return b"".join(event + b"\n\n" for event in kept)

    def flush(self) -> bytes:
        """Bytes left after the last complete event (forwarded as they are)."""
        rest, self._pending = self._pending, b""
        return rest


def ask_engine_for_usage(body: dict) -> bool:
    """Set ``stream_options.include_usage`` in a streaming request ``body`` (the engine's ``cached_tokens``
    corrects the prefix index); whether the client itself asked for usage (then its usage event is kept)."""
    options = body.get("stream_options")
    client_wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return client_wants_usage


def upstream_error(status: int, payload: bytes, headers: dict) -> web.Response:
    """An engine's non-200 answer (HTTP ``status``, body ``payload``) in OpenAI's error shape, with ``headers``.

    SGLang 0.5.23 answers OpenAI routes with a flat ``{"object": "error", "message",
    "type", "param", "code"}``; clients expect ``{"error": {...}}``. A body that is
    neither becomes the message (first 1000 characters), type ``engine_error``.
    """
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
    elif isinstance(body, dict) and "message" in body:
        error = {k: body.get(k) for k in ("message", "type", "param", "code")}
    else:
        error = {"message": payload.decode(errors="replace")[:1000] or f"engine answered HTTP {status}", "type": "engine_error", "param": None, "code": None}
    return web.json_response({"error": error}, status=status, headers=headers, dumps=dumps)


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
