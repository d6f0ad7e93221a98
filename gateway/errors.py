"""OpenAI-style errors: one exception type and one middleware that renders every failure.

Body shape (OpenAI API): ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

log = logging.getLogger("laps.gateway")


class APIError(Exception):
    """An error to return to the client as an OpenAI error body with HTTP ``status`` (and ``headers``)."""

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
        return web.json_response(self.body(), status=self.status, headers=self.headers, dumps=lambda o: orjson.dumps(o).decode())


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
        return APIError(err.status, f"{request.method} {request.path}: {err.reason}", type=kind).response()
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return APIError(500, "internal gateway error; see the gateway log", type="internal_error").response()
