"""OpenAI-style errors: one exception type and one middleware that renders every failure; an error's outcome label
(:func:`outcome_of`) and the count and log line of a request the gateway refuses itself (:func:`note_refusal`).

Body shape (OpenAI API): ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_urldispatcher import _default_expect_handler  # what a route without expect_handler= gets

from gateway.registry import EngineState

log = logging.getLogger("laps.gateway")

MALFORMED_MESSAGE_CHARS = 200  # of aiohttp's reason in the log line of a malformed request
REFUSAL_TEXT_CHARS = 200  # of a refused request's error message and param in its log line
UNPLACED = "unplaced"  # the class label of a request that no engine took (laps_requests_total, the request log)


class APIError(Exception):
    """An error to return to the client as an OpenAI error body with HTTP ``status`` (and ``headers``); with
    ``close_connection`` the answer closes the connection (``Connection: close``)."""

    close_connection = False

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers: dict[str, str] = {}
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        response = web.json_response(self.body(), status=self.status, headers=self.headers, dumps=lambda o: orjson.dumps(o).decode())
        if self.close_connection:
            response.force_close()
        return response


def outcome_of(api_error: APIError) -> str:
    """The ``laps_requests_total`` outcome of a request that ended with ``api_error``: its code (``engine_timeout``,
    ``shutting_down`` ...), else ``http_<status>``."""
    return api_error.code if isinstance(api_error.code, str) else f"http_{api_error.status}"


def note_refusal(request: web.Request, err: APIError, requests: Callable[[str], Any], took_s: float) -> None:
    """Count and log a request the gateway refused itself with ``err`` (``requests``: the ``unplaced`` class's
    ``laps_requests_total`` by outcome): one INFO line with the path, the client's address, the outcome and what was
    wrong, the client's text in it quoted (``%r``: a newline in it cannot start a line of its own) and cut to
    :data:`REFUSAL_TEXT_CHARS`."""
    outcome = outcome_of(err)
    requests(outcome).inc()
    param = None if err.param is None else err.param[:REFUSAL_TEXT_CHARS]
    log.info("%s %s from %s refused: class=%s outcome=%s param=%r (%r) %.1f ms", request.method, request.path, request.remote, UNPLACED,
             outcome, param, err.message[:REFUSAL_TEXT_CHARS], 1e3 * took_s)


def single_header(request: web.Request, name: str) -> str | None:
    """The value of the client's header ``name`` (None: not sent).

    Raises:
        APIError: 400, param ``name``: the header was sent more than once (which one should count is a guess).
    """
    values = request.headers.getall(name, [])
    if len(values) > 1:
        raise APIError(400, f"header {name} was sent {len(values)} times; send it once", param=name)
    return values[0] if values else None


class EngineUnavailable(APIError):
    """An engine could not be reached, dropped the connection or sent a broken answer (HTTP 502).

    ``engine``: the state of the engine the request ran on (a gateway worker's registry may hold another under its id
    since: :meth:`gateway.sched_worker.MirrorRegistry.renew`). The client's message names the engine only
    (``engine_id``); ``detail`` says what happened, for the gateway log. ``retryable``: a request that got it before
    its client got anything is tried once more on another engine (:func:`gateway.handlers._dispatch`).
    """

    retryable = True

    def __init__(self, engine: EngineState, detail: str, *, status: int = 502, code: str = "engine_unavailable",
                 message: str | None = None) -> None:
        super().__init__(status, message or f"engine {engine.id} failed to answer; retry later", type="engine_error", code=code)
        self.engine = engine
        self.engine_id = engine.id
        self.detail = detail


class EngineTimeout(EngineUnavailable):
    """An engine sent nothing for longer than the request's first-byte or stall timeout, or was taken out of
    service before its first byte (HTTP 504); ``detail`` says which limit."""

    def __init__(self, engine: EngineState, detail: str, message: str | None = None) -> None:
        super().__init__(engine, detail, status=504, code="engine_timeout", message=message or f"engine {engine.id} stopped answering; retry later")


class AnswerTooLong(EngineTimeout):
    """An answer did not end within ``gateway.request_timeout_s``: a limit on the request, which says nothing of its
    engine's health (a long generation on a busy engine takes long); :func:`gateway.health.engine_failed` leaves the
    engine to its generation probe. Not retried: the limit is the request's, spent already."""

    retryable = False

    def __init__(self, engine: EngineState) -> None:
        super().__init__(engine, "the answer did not end within gateway.request_timeout_s",
                         f"the answer of engine {engine.id} did not end within the gateway's request timeout; ask for fewer tokens or retry later")


class BodyTooLarge(APIError):
    """A request body over the gateway's limit of ``limit_bytes`` (HTTP 413); ``received_bytes``: its size when the
    client declared it (``Content-Length``), ``None`` when it was found over the limit while being read (chunked, or
    compressed and larger once decompressed). The connection is closed (aiohttp first reads and drops what
    still comes, for up to 10 s)."""

    close_connection = True

    def __init__(self, limit_bytes: int, received_bytes: int | None) -> None:
        size = "" if received_bytes is None else f" of {received_bytes} bytes (Content-Length)"
        super().__init__(413, f"request body{size} is over the gateway's limit of {limit_bytes} bytes ({limit_bytes / 2**20:g} MiB)",
                         code="request_too_large")
        self.limit_bytes = limit_bytes
        self.received_bytes = received_bytes


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The ``expect_handler`` of the routes that take a body: ``Expect: 100-continue`` with a Content-Length over
    the body limit (``request.client_max_size``) is answered at once with :class:`BodyTooLarge`'s 413, without the
    ``100 Continue`` that would have the client send the body first; any other ``Expect`` as aiohttp answers it
    (``100 Continue``; 417 for an expectation it does not know)."""
    if request.content_length is not None and request.content_length > request.client_max_size:
        return BodyTooLarge(request.client_max_size, request.content_length).response()
    return await _default_expect_handler(request)


class BodyTimeout(APIError):
    """A request body that did not arrive within ``timeout_s`` seconds of its head (``gateway.body_timeout_s``;
    HTTP 408). The connection is closed."""

    close_connection = True

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s (gateway.body_timeout_s)", code="request_timeout")


class ShuttingDown(APIError):
    """The gateway is shutting down: a request it will not finish (HTTP 503)."""

    def __init__(self) -> None:
        super().__init__(503, "the gateway is shutting down; retry on another instance or later", type="service_unavailable", code="shutting_down")


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Turn :class:`APIError`, aiohttp's HTTP errors and unexpected exceptions into OpenAI error bodies."""
    try:
        return await handler(request)
    except APIError as err:
        return err.response()
    except web.HTTPException as err:
        if err.status < 400:
            raise
        kind = "not_found_error" if err.status == 404 else "invalid_request_error"
        error = APIError(err.status, f"{request.method} {request.path}: {err.reason}", type=kind)
        if "Allow" in err.headers:  # a 405 names the methods the path takes (RFC 9110 §15.5.6)
            error.headers["Allow"] = err.headers["Allow"]
        return error.response()
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return APIError(500, "internal gateway error; see the gateway log", type="internal_error").response()


class ServerLog(logging.LoggerAdapter):
    """aiohttp's server logger (``aiohttp.server``) as the gateway's HTTP server uses it (``logger=`` of its
    runner): a request aiohttp cannot parse (a request or header line over 8,190 bytes, more than 128 headers, a bad
    Content-Length, Content-Length with Transfer-Encoding, a bad method, a bad chunk) is one INFO line
    (``malformed HTTP request from <address> (answered 400): <aiohttp's reason>``), not an ERROR with a traceback,
    since any client can send them; aiohttp still answers it with its plain-text 400 and closes the connection.
    Every other error is logged as aiohttp logs it."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        if not isinstance(exc_info, HttpProcessingError):
            super().exception(msg, *args, exc_info=exc_info, **kwargs)
            return
        if not self.isEnabledFor(logging.INFO):
            return
        # aiohttp's reason spans lines (the bad line, a caret under the culprit): one line, printable, bounded
        reason = " ".join(line.strip() for line in exc_info.message.splitlines() if line.strip(" ^"))
        reason = "".join(c if c.isprintable() else repr(c)[1:-1] for c in reason)
        if len(reason) > MALFORMED_MESSAGE_CHARS:
            reason = reason[:MALFORMED_MESSAGE_CHARS] + "..."
        remote = args[0] if args else None
        self.info("malformed HTTP request from %s (answered %s): %s: %s", remote, exc_info.code or 400, type(exc_info).__name__, reason)
