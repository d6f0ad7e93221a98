"""A scriptable SGLang-compatible test double: records what it receives, signals explicitly, never sleeps."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web


class FakeEngine:
    """Serves ``/ready``, ``/v1/chat/completions``, ``/v1/completions`` and ``/abort_request``.

    ``hold_streams``: after the first chunk a stream waits for :attr:`release`.
    ``break_streams``: after the first chunk the engine drops the connection.
    ``error_reply``: ``(status, body)`` to answer every generation with.
    ``reported_cached_tokens``: the ``cached_tokens`` its stream usage reports.
    ``hold_answers``: every generation waits for :attr:`answer` before answering
    (:attr:`received` is set when one has arrived).
    ``hold_eof``: a stream waits for :attr:`release` after its ``data: [DONE]``
    before it ends (:attr:`done_sent` is set then).
    ``hold_first``: a stream waits for :attr:`release` before its first chunk.
    ``stream_end``: what a stream sends after its first chunk instead of the rest:
    ``"truncated"`` (it just ends, no ``[DONE]``) or ``"malformed"`` (an event that is not JSON).
    ``GET /health_generate`` (SGLang's generation probe) answers :attr:`probe_status` (200 unless set); :attr:`probed`
    is set at each.
    ``GET /v1/models`` lists the model with ``max_model_len`` when :attr:`max_model_len` is set (as SGLang lists it).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []  # each generation request's headers
        self.aborted: list[str] = []
        self.abort_seen = asyncio.Event()
        self.release = asyncio.Event()
        self.hold_streams = False
        self.break_streams = False
        self.error_reply: tuple[int, bytes] | None = None
        self.reported_cached_tokens = 0
        self.hold_answers = False
        self.answer = asyncio.Event()
        self.hold_eof = False
        self.hold_first = False
        self.stream_end: str | None = None
        self.done_sent = asyncio.Event()
        self.received = asyncio.Event()
        self.max_model_len: int | None = None
        self.finish_reason = "stop"  # of every answer ("abort": SGLang's end of an aborted request without an error status)
        self.probe_status = 200
        self.probed = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_get("/ready", self._ready)
        self.app.router.add_get("/health_generate", self._probe)
        self.app.router.add_post("/v1/chat/completions", self._generate)
        self.app.router.add_post("/v1/completions", self._generate)
        self.app.router.add_post("/abort_request", self._abort)
        self.app.router.add_get("/v1/models", self._models)

    async def _ready(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _probe(self, request: web.Request) -> web.Response:
        self.probed.set()
        return web.Response(status=self.probe_status)

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": "fake", "object": "model"} if self.max_model_len is None else {"id": "fake", "object": "model", "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def _abort(self, request: web.Request) -> web.Response:
        self.aborted.append((await request.json())["rid"])
        self.abort_seen.set()
        return web.Response()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        self.received.set()
        if self.hold_answers:
            await self.answer.wait()
        if self.error_reply is not None:
            return web.Response(status=self.error_reply[0], body=self.error_reply[1])
        chunk = {"id": body["rid"], "choices": [{"index": 0, "delta": {"content": f"hi from {self.name}"}, "finish_reason": None}]}
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk["usage"] = None  # as SGLang 0.5.23 writes it into every chunk but the usage event
        if not body.get("stream"):
            usage = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": self.reported_cached_tokens}}
            return web.json_response({"id": body["rid"], "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": f"hi from {self.name}"}, "finish_reason": self.finish_reason}], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.hold_first:
            await self.release.wait()
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        if self.stream_end is not None:
            await response.write(b'data: {"id": "x", "choi' if self.stream_end == "truncated" else b"data: <html>oops</html>\n\n")
            await response.write_eof()
            return response
        if self.break_streams:
            request.transport.close()
            return response
        if self.hold_streams:
            await self.release.wait()
        last = {"id": body["rid"], "choices": [{"index": 0, "delta": {}, "finish_reason": self.finish_reason}], **({"usage": None} if "usage" in chunk else {})}
        await response.write(b"data: " + orjson.dumps(last) + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": self.reported_cached_tokens}}
            await response.write(b"data: " + orjson.dumps({"id": body["rid"], "choices": [], "usage": usage}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        self.done_sent.set()
        if self.hold_eof:
            await self.release.wait()
        await response.write_eof()
        return response
