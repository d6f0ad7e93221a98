"""Prefill–decode (PD) dispatch: one request goes to a prefill engine and a decode engine at once.

The scheduler has already chosen the prefill engine (it sees only the prefill
pools; :meth:`gateway.registry.EngineRegistry.views`). :func:`relay` then

1. picks the decode engine with the decode placement
   (:func:`policies.registry.make_decode_placement`, ``scheduling.decode_placement``)
   over :meth:`~gateway.registry.EngineRegistry.decode_views`
   (:meth:`gateway.pd_setup.PDDispatch.take_decode`; with several gateway
   workers the scheduler process has picked it with the prefill engine:
   :class:`gateway.sched_worker.RemoteDecodeSide`);
2. adds SGLang's PD routing fields to the request body, as SGLang's own PD
   router does (sglang-router ``mini_lb``; SGLang 0.5.23
   ``entrypoints/openai/protocol.py`` ``PDRoutingFields``: top-level keys of
   the OpenAI body): ``bootstrap_host`` (the prefill engine's host),
   ``bootstrap_port`` (its KV bootstrap port, :meth:`laps.config.Config.bootstrap_port`)
   and ``bootstrap_room`` (a random 63-bit integer naming this transfer);
3. sends the same body to both engines concurrently and relays the decode
   engine's answer (stream or JSON); its text goes into the caller's
   :class:`~gateway.relay.Reply` (the chat cache keeps the chat with its
   reply). The prefill engine's answer is read and only its ``cached_tokens``
   kept: its prefix cache is the one the next turn hits, so the prefix index
   learns the prompt there (not the reply: a prefill engine never computes the
   reply's KV);
4. ends both sides together: a client that goes away before it has the whole
   answer aborts both (the prefill side by the caller,
   :func:`gateway.handlers._serve_once`); a failure on either side aborts the
   other and reaches the client as one OpenAI error naming the engine
   (``x-laps-failed-engine``), as an HTTP error before the stream starts and
   as an in-stream error event after;
5. the client's ``usage.prompt_tokens_details.cached_tokens`` is the prefill
   engine's (the decode engine computes no prompt); once the decode side has
   answered, the client has its whole answer at once (a JSON answer waits at
   most ``PREFILL_REPORT_WAIT_S`` for the prefill engine's figure): the prefill
   engine's answer is then awaited at most ``PREFILL_GRACE_S`` more (its
   ``cached_tokens``), after which the prefill side is cancelled and aborted
   (e.g. a failed KV hand-off: the prefill engine may never answer).

The prefill engine counts the request in its gateway-side load only until its
prefill answer is in (its first token: the scheduler hears it then); the
decode engine counts it until the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Sequence

import orjson
from aiohttp import web

from engines.client import EngineHTTPError
from gateway.errors import APIError, EngineUnavailable, ShuttingDown, outcome_of
from gateway.guard import RequestGuard
from gateway.health import engine_failed
from gateway.pd_setup import DecodeSide, bootstrap_room, no_decode_engine
from gateway.relay import ClientGone, Reply, SSERelay, StreamTap, ask_engine_for_usage, error_of_answer, in_background, send_now, unreachable, with_cached_tokens
from gateway.state import Gateway
from policies.types import RequestView

log = logging.getLogger("laps.gateway")

FAILED_ENGINE_HEADER = "x-laps-failed-engine"
DECODE_ENGINE_HEADER = "x-laps-decode-engine"
# How long the prefill engine's answer is still awaited once the decode side has answered (seconds). It normally
# came in long before (the decode side needs the prefill's KV first); only a failed hand-off leaves it hanging.
PREFILL_GRACE_S = 1.0
# How long a JSON answer waits for the prefill engine's answer, for its cached_tokens (seconds); it is normally in
# already, and a hanging prefill side must not hold the client's answer back.
PREFILL_REPORT_WAIT_S = 0.2
# A usage event's object, as against SGLang's ``"usage":null`` in every other chunk of a stream.
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')


class _SideFailed(Exception):
    """One side of the pair failed; ``error`` is the client's error, ``engine_id`` the failed engine."""

    def __init__(self, engine_id: str, error: APIError) -> None:
        super().__init__(error.message)
        self.engine_id = engine_id
        self.error = error


def _engine_error(engine_id: str, side: str, status: int, payload: bytes) -> APIError:
    """An engine's non-200 answer as an :class:`APIError` with the same status, naming the side and engine."""
    err = error_of_answer(engine_id, status, payload)
    if err.code != "engine_failed":  # that message names the engine already
        err.message = f"{side} engine {engine_id}: {err.message}"
    err.headers[FAILED_ENGINE_HEADER] = engine_id
    return err


def _cached_tokens(payload: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` out of an engine's JSON answer or SSE stream."""
    reply = Reply()
    if payload.startswith(b"{"):
        with contextlib.suppress(orjson.JSONDecodeError):
            reply.take(orjson.loads(payload))
        return reply.cached_tokens
    tap = StreamTap(reply, drop_usage=False)
    tap.feed(payload + b"\n\n")
    return reply.cached_tokens


async def relay(request: web.Request, gw: Gateway, path: str, body: dict, headers: dict, view: RequestView,
                prefill_id: str, guard: RequestGuard, reply: Reply, stream: bool,
                prompt_keys: Sequence[int]) -> tuple[web.StreamResponse, str]:
    """Serve ``view`` (already admitted to ``prefill_id``) on a prefill–decode pair; see the module docstring.

    Once the prefill engine has answered, the prompt (its block keys ``prompt_keys``) is in that engine's prefix
    cache: the prefix index takes the engine's report on it then, while the decode side may still run, so that the
    conversation's next turn is routed with it (:attr:`~gateway.relay.Reply.prompt_observed`).

    ``reply`` receives the decode engine's text and the prefill engine's
    reported ``cached_tokens`` (``None`` if the prefill engine did not answer
    in time); the client's ``usage`` reports that figure too. ``guard`` cuts
    the pair's wait short (:mod:`gateway.guard`): the decode engine's bytes
    are its progress; the prefill engine is blamed for a timeout until it has
    answered. Returns the client's response and the outcome (``ok``,
    ``http_<status>``, ``engine_unavailable``, ``engine_timeout`` ...).

    Raises:
        APIError: 503 when no decode engine is healthy; a side's error before
            the response started (with ``x-laps-failed-engine``).
        EngineUnavailable: a side could not be reached before the
            response started (the caller marks it down and retries once).
        asyncio.CancelledError, ClientGone: the client went away;
            the decode side is aborted here.
    """
    pd: DecodeSide = gw.pd
    decode_id = pd.take_decode(gw.registry, view.rid, view.prompt_tokens, stream, gw.dispatcher.clock())
    if decode_id is None:
        raise no_decode_engine()
    host, port = pd.bootstrap[prefill_id]
    body.update(bootstrap_host=host, bootstrap_port=port, bootstrap_room=bootstrap_room())
    headers[DECODE_ENGINE_HEADER] = decode_id
    gw.metrics.in_flight_of(decode_id).inc()
    pair = _Pair(request, gw, path, body, headers, view, prefill_id, decode_id, guard, reply, stream, prompt_keys)
    try:
        return await pair.run()
    except (ClientGone, asyncio.CancelledError):
        in_background(gw.client.abort(pair.decode.url, view.rid))
        raise
    finally:
        gw.metrics.in_flight_of(decode_id).dec()
        pd.release_decode(gw.registry, view.rid, decode_id, view.prompt_tokens, gw.dispatcher.clock())


class _Pair:
    """One request in flight on a prefill engine and a decode engine (see :func:`relay`); ``prefill`` and ``decode``:
    their states as the request found them (a gateway worker's registry may hold others under their ids later:
    :meth:`gateway.sched_worker.MirrorRegistry.renew`)."""

    def __init__(self, request: web.Request, gw: Gateway, path: str, body: dict, headers: dict, view: RequestView,
                 prefill_id: str, decode_id: str, guard: RequestGuard, reply: Reply, stream: bool, prompt_keys: Sequence[int]) -> None:
        self.request, self.gw, self.path, self.body, self.headers, self.view = request, gw, path, body, headers, view
        self.prefill_id, self.decode_id, self.guard, self.reply, self.stream = prefill_id, decode_id, guard, reply, stream
        self.prefill, self.decode = gw.registry[prefill_id], gw.registry[decode_id]
        self.prompt_keys = prompt_keys
        self.response: web.StreamResponse | None = None
        self.sse: SSERelay | None = None
        self.client_wants_usage = False
        self.prefill_cached_tokens: int | None = None
        self.prefill_done_s = float("inf")  # when the prefill engine's answer came in (dispatcher clock)
        self._prefill_task: asyncio.Future | None = None

    async def run(self) -> tuple[web.StreamResponse, str]:
        try:
            with self.guard.watching(self.decode, self.stream, also=self.prefill):
                return await self._run()
        except (EngineUnavailable, ShuttingDown) as err:  # the guard cut the pair off
            if err is not self.guard.reason:  # a side's own failure: _run has aborted the other side already
                raise
            for engine in (self.prefill, self.decode):
                in_background(self.gw.client.abort(engine.url, self.view.rid))
            return await self._fail(err)

    async def _run(self) -> tuple[web.StreamResponse, str]:
        if self.stream:
            # Both sides report usage: the prefill engine's cached_tokens corrects the prefix index.
            self.client_wants_usage = ask_engine_for_usage(self.body)
        prefill = self._prefill_task = asyncio.ensure_future(self._prefill())
        decode = asyncio.ensure_future(self._decode())
        try:
            await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
            if prefill.done() and prefill.exception() is not None and not decode.done():
                await _cancel(decode)
                in_background(self.gw.client.abort(self.decode.url, self.view.rid))
                return await self._fail(prefill.exception())
            await asyncio.wait((decode,))
            if decode.exception() is not None:
                if isinstance(decode.exception(), ClientGone):
                    raise decode.exception()  # both sides are aborted on the way out
                await _cancel(prefill)
                in_background(self.gw.client.abort(self.prefill.url, self.view.rid))
                return await self._fail(decode.exception())
            await self._settle_prefill(prefill)
            return self.response, "ok"
        finally:
            await _cancel(prefill)
            await _cancel(decode)
            self.reply.cached_tokens = self.prefill_cached_tokens  # the prefill engine's report, not the decode engine's

    async def _settle_prefill(self, prefill: asyncio.Future) -> None:
        """The decode side has answered: give the prefill side ``PREFILL_GRACE_S`` to answer, then cancel and abort it."""
        await asyncio.wait((prefill,), timeout=PREFILL_GRACE_S)
        if not prefill.done():
            log.warning("%s: decode on %s finished but prefill on %s did not answer within %.1f s; aborting it",
                        self.view.rid, self.decode_id, self.prefill_id, PREFILL_GRACE_S)
            await _cancel(prefill)
            in_background(self.gw.client.abort(self.prefill.url, self.view.rid))
        elif prefill.exception() is not None:
            log.warning("%s: decode on %s finished but prefill on %s failed: %s", self.view.rid, self.decode_id, self.prefill_id, prefill.exception())

    async def _fail(self, err: BaseException) -> tuple[web.StreamResponse, str]:
        """Turn one side's failure into the client's one error (HTTP before the stream, an SSE event after)."""
        if isinstance(err, _SideFailed):
            api_error, outcome = err.error, f"http_{err.error.status}"
            if self.response is None:
                api_error.headers = {**self.headers, **api_error.headers}
                return api_error.response(), outcome
        elif isinstance(err, APIError):  # EngineUnavailable: before the response, the caller retries elsewhere
            api_error, outcome = err, outcome_of(err)
            if self.response is None:
                raise err
            if isinstance(err, ShuttingDown):  # the engines did nothing wrong
                log.info("%s: stream to PD pair %s/%s cut: the gateway is shutting down; the stream ends with an error event", self.view.rid,
                         self.prefill_id, self.decode_id)
            else:
                log.warning("%s: PD pair %s/%s failed mid-stream (%s); the stream ends with an error event", self.view.rid,
                            self.prefill_id, self.decode_id, getattr(err, "detail", err.message))
            if isinstance(err, EngineUnavailable):
                engine_failed(self.gw, err)
        else:
            raise err
        return await self.sse.fail(api_error), outcome

    async def _prefill(self) -> None:
        """Send the request to the prefill engine and read its whole answer (it ends when the prefill does)."""
        engine = self.prefill
        try:
            async with self.gw.client.post(engine.url, self.path, self.body) as upstream:
                payload = await upstream.read()
                status = upstream.status
        except EngineHTTPError as err:
            raise unreachable(engine, err) from None
        if status != 200:
            raise _SideFailed(self.prefill_id, _engine_error(self.prefill_id, "prefill", status, payload))
        self.prefill_cached_tokens = _cached_tokens(payload)
        self.gw.prefix_index.observe(self.prefill_id, self.prompt_keys, self.prefill_cached_tokens,
                                     self.view.cached_by_engine.get(self.prefill_id, 0))
        self.reply.prompt_observed = True
        self.guard.also = None  # the prefill is done: a stall from now on is the decode engine's
        self.prefill_done_s = self.gw.dispatcher.clock()
        self.gw.dispatcher.first_token(self.view.rid, self.prefill_id, self.prefill_cached_tokens, load_ends=True)

    async def _decode(self) -> str:
        """Send the request to the decode engine and relay its whole answer to the client (its text into
        :attr:`reply`, which is then :attr:`~gateway.relay.Reply.done`; its usage with the prefill engine's
        ``cached_tokens``); the outcome."""
        engine = self.decode
        try:
            async with self.gw.client.post(engine.url, self.path, self.body, stream=self.stream) as upstream:
                if upstream.status != 200:
                    raise _SideFailed(self.decode_id, _engine_error(self.decode_id, "decode", upstream.status, await upstream.read()))
                if not self.stream:
                    return await self._relay_json(await upstream.read())
                self.sse = SSERelay(self.request, self.gw, self.headers, StreamTap(self.reply, drop_usage=not self.client_wants_usage,
                                                                          cached_tokens=lambda: self.prefill_cached_tokens),
                                    self.guard, engine, self._first_bytes)
                await self.sse.pump(self._usage_after_prefill(upstream.chunks()))
        except EngineHTTPError as err:
            raise unreachable(engine, err) from None
        finally:
            if self.sse is not None:
                self.response = self.sse.response
        await self.sse.finish()
        return "ok"

    async def _usage_after_prefill(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The decode engine's ``chunks``; the one where a usage object begins (``"usage":{``, also across two
        chunks; not SGLang's ``"usage":null`` of every chunk) waits for the prefill engine's answer, up to
        ``PREFILL_REPORT_WAIT_S``, so that the usage relayed reports the prefill engine's ``cached_tokens``. That
        answer is normally in long before (the decode side needs the prefill's KV first), but the two travel on
        separate connections and nothing orders their arrival at the gateway."""
        tail = b""
        async for chunk in chunks:
            if self.prefill_cached_tokens is None and not self._prefill_task.done():  # normally long done
                if _USAGE_OBJECT.search(tail + chunk):
                    await self._prefill_report()
                tail = chunk[-16:]
            yield chunk

    async def _prefill_report(self) -> None:
        """Wait for the prefill engine's answer (its ``cached_tokens``), at most ``PREFILL_REPORT_WAIT_S``."""
        await asyncio.wait((self._prefill_task,), timeout=PREFILL_REPORT_WAIT_S)

    def _first_bytes(self) -> None:
        self.gw.metrics.of_class(self.view.request_class).ttft.observe(time.monotonic() - self.view.arrival_s)
        self._decoding()

    def _decoding(self) -> None:
        """The decode engine's first token reaches the client: for the decode placement, and for the controller's
        decode sizing, late when after the deadline although the prefill was done by then (the transfer and the
        decode admission made it late)."""
        now = self.gw.dispatcher.clock()
        self.gw.pd.decoding(self.gw.dispatcher.first_tokens, self.view.rid, self.decode_id, now,
                            now > self.view.deadline_s >= self.prefill_done_s)

    async def _relay_json(self, payload: bytes) -> str:
        """Send the decode engine's JSON answer, its usage with the prefill engine's ``cached_tokens`` (awaited up to
        ``PREFILL_REPORT_WAIT_S``: it normally came long before), without waiting until the prefill side is settled."""
        self._decoding()
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            raise EngineUnavailable(self.decode, f"answer is not a JSON object: {payload[:200]!r}")
        self.reply.take(obj)
        await self._prefill_report()
        if self.prefill_cached_tokens is not None and isinstance(obj.get("usage"), dict):
            payload = orjson.dumps({**obj, "usage": with_cached_tokens(obj["usage"], self.prefill_cached_tokens)})
        self.response = web.Response(body=payload, status=200, content_type="application/json", headers=self.headers)
        await send_now(self.request, self.response)  # not held back until the prefill side is settled
        self.reply.done = True
        return "ok"


async def _cancel(task: asyncio.Future) -> None:
    """Cancel ``task`` if it still runs and wait for it; its own failure was handled (or is moot) by now."""
    if not task.done():
        task.cancel()
    with contextlib.suppress(BaseException):
        await task
