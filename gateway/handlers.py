"""HTTP handlers: validate -> tokenize -> classify -> pick an engine -> relay.

Every accepted request ends with the engine's answer or an explicit OpenAI
error: before the response starts, as an HTTP error body; once a stream has
started, as an in-stream ``data: {"error": ...}`` event followed by ``[DONE]``.
When the client goes away before it has the whole answer, the engine is told to
abort the request; a client that leaves once it has it (e.g. right after a
stream's ``[DONE]``) does not cut the request's bookkeeping short.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import os
import re
import time
from collections.abc import Sequence

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from engines.client import EngineHTTPError
from gateway import content_encoding, pd_dispatch
from gateway.auth import admin_key_given
from gateway.dispatcher import Arrival
from gateway.errors import (UNPLACED, AnswerTooLong, APIError, BodyTimeout, BodyTooLarge, EngineTimeout, EngineUnavailable, ShuttingDown, note_refusal,
                            outcome_of, single_header)
from gateway.guard import RequestGuard
from gateway.health import engine_failed
from gateway.priority import set_engine_priority, view_priority
from gateway.relay import ClientGone, Reply, SSERelay, StreamTap, ask_engine_for_usage, dumps, in_background, unreachable, upstream_error
from gateway.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from gateway.registry import EngineState
from gateway.state import GATEWAY, Gateway
from gateway.tracing import child_span
from laps.chat_cache import EncodedPrompt
from laps.json_depth import MAX_DEPTH, too_deep
from laps.tokenizer import min_tokens, template_tools
from policies.output_predictor import reply_token_counts
from policies.prefix_index import BlockChain
from policies.types import RequestView

log = logging.getLogger("laps.gateway")

SLO_HEADER = "x-laps-slo-ttft-s"
_SECONDS = re.compile(r"[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?")  # not float()'s "1_0", "inf", other digits
# Request ids: this process's random prefix + a counter. The engines' abort_request matches ids of requests still
# running, so ids must not repeat across gateway restarts: the 64 random bits keep them apart. (``uuid4().hex`` costs
# ~2 µs a request, this ~0.2 µs.)
_RID_PREFIX = os.urandom(8).hex()
_rid_counter = itertools.count()
# A retry's engine rid is the first try's with this suffix (still unique; the two show up together in the log).
RETRY_RID_SUFFIX = "-retry"


def next_request_id() -> str:
    """A request id unique within this process and, by its random 64-bit prefix, across restarts: ``<16 hex>-<n>``."""
    return f"{_RID_PREFIX}-{next(_rid_counter):x}"


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request's body, read within ``timeout_s`` seconds (``gateway.body_timeout_s``), decoded from its
    ``Content-Encoding`` (:mod:`gateway.content_encoding`).

    Raises:
        BodyTooLarge: the body is over ``request.client_max_size`` (``MAX_BODY_BYTES``); by its Content-Length
            before any of it is read, else once the bytes read, or decoded, pass it.
        BodyTimeout: the body did not arrive in time.
        APIError: 415 for a ``Content-Encoding`` the gateway does not decode, 400 for a body that is not what its
            ``Content-Encoding`` says.
    """
    coding = content_encoding.coding_of(request.headers.getall("Content-Encoding", []))
    limit = request.client_max_size
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(limit, request.content_length)
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BodyTooLarge(limit, None) from None
    except TimeoutError:
        raise BodyTimeout(timeout_s) from None
    if coding is None:
        return raw
    return await asyncio.get_running_loop().run_in_executor(None, content_encoding.decode, coding, raw, limit)


_JSON_TYPE_NAMES = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
                    list: "an array"}



async def _json_body(request: web.Request, timeout_s: float) -> dict:
    if request.content_type != "application/json":
        # aiohttp reads a missing header as application/octet-stream; say what the client sent
        sent = repr(request.content_type) if "Content-Type" in request.headers else "no Content-Type header"
        raise APIError(415, f"Content-Type must be application/json, got {sent}", param="Content-Type",
                       code="unsupported_media_type")
    raw = await read_body(request, timeout_s)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        try:
            raw.decode()
        except UnicodeDecodeError as bad:  # orjson's own words for this are about surrogates
            raise APIError(400, f"request body is not valid UTF-8: byte 0x{raw[bad.start]:02x} at offset {bad.start}") from None
        raise APIError(400, f"request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {_JSON_TYPE_NAMES.get(type(body), type(body).__name__)}")
    if too_deep(body, raw):
        raise APIError(400, f"request body nests arrays and objects deeper than {MAX_DEPTH} levels, more than the gateway passes on")
    return body


def _nulls_dropped(body: dict, schema: type[BaseModel]) -> dict:
    """``body`` without its top-level keys sent as null, but for ``schema``'s required ones (refused by validation).

    In OpenAI's API an optional parameter sent as null takes its default ("stream": null is a plain answer); SGLang
    0.5.23 refuses null where its field is a plain bool, int or float (stream, n, logprobs, echo, a completion's
    temperature ...), so such keys go neither to validation nor to the engine.
    """
    return {k: v for k, v in body.items() if v is not None or (k in schema.model_fields and schema.model_fields[k].is_required())}


def _body_path(loc: tuple, body: dict, missing: bool) -> tuple:
    """``loc`` of a pydantic error without its union member tags (``stop.str``, ``stop.list[str]``): only the keys
    and indexes found in ``body`` are kept, plus the last one when the error is a missing key."""
    path, value = [], body
    for i, part in enumerate(loc):
        if isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            path.append(part)
            value = value[part]
        elif isinstance(value, dict) and part in value:
            path.append(part)
            value = value[part]
        elif missing and i == len(loc) - 1:
            path.append(part)
    return tuple(path)


def _validate(model: type[BaseModel], body: dict) -> BaseModel:
    """``body`` validated as ``model``.

    Raises:
        APIError: 400 naming the parameter as a path into the body (``messages.0.role``). Of the errors under the
            first one's top-level key, the deepest is reported (the union member that got furthest); errors of
            several union members at that same path are joined with "or".
    """
    try:
        return model.model_validate(body)
    except ValidationError as err:
        errors = [(_body_path(e["loc"], body, e["type"] == "missing"), _error_message(e)) for e in err.errors()]
        top = errors[0][0][:1]
        path = max((p for p, _ in errors if p[:1] == top), key=len)
        message = " or ".join(dict.fromkeys(m for p, m in errors if p == path))
        param = ".".join(str(p) for p in path) or None
        raise APIError(400, f"{param}: {message}" if param else message, param=param) from None


def _error_message(error: dict) -> str:
    """pydantic's message for one error, in the client's terms: an integer too large for 64 bits (which the JSON parser
    hands over as a float) is said to be that, not "not a valid integer"."""
    value = error.get("input")
    if error["type"].startswith("int_") and isinstance(value, float) and value.is_integer() and abs(value) >= 2**63:
        return "Input should be an integer that fits in 64 bits (signed)"
    return error["msg"].removeprefix("Value error, ")


def _check_model(gw: Gateway, model: str) -> None:
    if model != gw.config.model.name:
        raise APIError(404, f"The model `{model}` does not exist; this gateway serves `{gw.config.model.name}`.", param="model", code="model_not_found")


def _check_logit_bias(gw: Gateway, logit_bias: dict[str, float] | None) -> None:
    """Refuse a ``logit_bias`` token id past the vocabulary, as SGLang's ``SamplingParams.verify`` would.

    Raises:
        APIError: 400, param ``logit_bias``.
    """
    bad = next((k for k in logit_bias or () if int(k) >= gw.tokenizer.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"logit_bias: token id {bad} is outside the vocabulary (0 .. {gw.tokenizer.vocab_size - 1})", param="logit_bias")


# SGLang 0.5.23's CompletionRequest.max_tokens default (OpenAI's too); a chat's reply has no default cap.
COMPLETION_DEFAULT_MAX_TOKENS = 16


def _output_tokens(req: ChatCompletionRequest | CompletionRequest) -> int:
    """The reply's cap as the engine will take it (0: none given, for a chat)."""
    default = COMPLETION_DEFAULT_MAX_TOKENS if isinstance(req, CompletionRequest) else 0
    return req.max_completion_tokens or req.max_tokens or default


def _check_text_size(gw: Gateway, req: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse before tokenizing it a prompt whose text alone cannot fit the model's context length: at least
    :func:`laps.tokenizer.min_tokens` of its characters (the messages' text and tool calls,
    :meth:`ChatCompletionRequest.template_chars`, or a text prompt) plus the reply's cap (:func:`_output_tokens`, at least one
    token) past ``gw.context_tokens`` (unchecked when unknown). A 60 MB body is refused in milliseconds, not after a
    minute of tokenizing; whatever passes is tokenized and checked exactly by :func:`_check_context`.

    Raises:
        APIError: 400 ``context_length_exceeded``, param ``messages`` or ``prompt``.
    """
    limit = gw.context_tokens
    if limit is None:
        return
    if isinstance(req, ChatCompletionRequest) and req.input_ids is None:
        param, chars = "messages", req.template_chars()
    elif isinstance(req, CompletionRequest) and isinstance(req.prompt, str):
        param, chars = "prompt", len(req.prompt)
    else:
        return  # token ids: counted as they are
    at_least, output_tokens = min_tokens(chars, gw.tokenizer), _output_tokens(req)
    if at_least + max(output_tokens, 1) > limit:
        asked = f"{output_tokens} are" if output_tokens else "at least 1 is"  # no cap given: the engine still generates one
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, the text of the {param} alone ({chars} "
                            f"characters) is at least {at_least} tokens, and {asked} asked for the completion. Please "
                            f"reduce the length of the {param} or completion.", param=param, code="context_length_exceeded")


def _prompt_param(req: ChatCompletionRequest | CompletionRequest) -> str:
    """The request's field that holds its prompt: ``messages``, a chat's ``input_ids`` (SGLang's pre-tokenized prompt), or
    ``prompt``."""
    if isinstance(req, CompletionRequest):
        return "prompt"
    return "messages" if req.input_ids is None else "input_ids"


def _check_context(gw: Gateway, req: ChatCompletionRequest | CompletionRequest, prompt_tokens: int) -> None:
    """Refuse a request the engine could not serve: its prompt plus the reply's cap (:func:`_output_tokens`, at least
    one token to generate, as SGLang counts) past the model's context length (``gw.context_tokens``; unchecked when unknown).

    Raises:
        APIError: 400 ``context_length_exceeded`` (OpenAI's code), param ``messages``, ``input_ids`` or ``prompt``.
    """
    limit = gw.context_tokens
    output_tokens = _output_tokens(req)
    if limit is None or prompt_tokens + max(output_tokens, 1) <= limit:
        return
    param = _prompt_param(req)
    asked = f"{output_tokens}" if output_tokens else "at least 1"  # no cap given: the engine still generates one
    raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested {prompt_tokens + max(output_tokens, 1)} "
                        f"tokens ({prompt_tokens} in the {param}, {asked} in the completion). Please reduce the length of the {param} or completion.",
                   param=param, code="context_length_exceeded")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions`` (OpenAI), streaming or not."""
    return await _serve(request, ChatCompletionRequest, "/v1/chat/completions")


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` (OpenAI), one prompt as text or token ids, streaming or not."""
    return await _serve(request, CompletionRequest, "/v1/completions")


async def _serve(request: web.Request, schema: type[ChatCompletionRequest] | type[CompletionRequest], path: str) -> web.StreamResponse:
    """Check, tokenize and dispatch one request. One the gateway refuses itself (a bad body or header value, an unknown
    model, a prompt past the context, shutting down) is counted in ``laps_requests_total`` with class ``unplaced`` and
    its error's outcome, and logged (INFO) with what was wrong, so that a misbehaving client shows; one whose client
    leaves before it is placed, as ``client_gone``."""
    gw = request.app[GATEWAY]
    arrival_s = time.monotonic()
    try:
        if gw.closing:
            raise ShuttingDown()
        with child_span(gw.tracer, "validation"):
            body = _nulls_dropped(await _json_body(request, gw.config.gateway.body_timeout_s), schema)
            req = _validate(schema, body)
            _check_model(gw, req.model)
            _check_logit_bias(gw, req.logit_bias)
            _check_text_size(gw, req)
        with child_span(gw.tracer, "tokenization") as span:
            prompt = await _prompt_chain(gw, req, body)
            if span is not None:
                span.set_attribute("laps.prompt_tokens", prompt.prompt.tokens)
        _check_context(gw, req, prompt.prompt.tokens)
        deadline_s, priority = _deadline_s(request, arrival_s), view_priority(request, body, gw.config)
    except APIError as err:
        note_refusal(request, err, gw.metrics.of_class(UNPLACED).requests, time.monotonic() - arrival_s)
        raise
    except asyncio.CancelledError:  # the client went away while its body came in or its prompt was counted
        _count_unplaced(gw, "client_gone")
        log.info("%s %s from %s: outcome=client_gone (left before its request was checked and counted) %.1f ms", request.method,
                 path, request.remote, 1e3 * (time.monotonic() - arrival_s))
        raise
    return await _dispatch(request, gw, body, path, prompt, req.stream, arrival_s, deadline_s, priority)


def _count_unplaced(gw: Gateway, outcome: str) -> None:
    """Count a request no engine took under class ``unplaced`` (``client_gone``: also a client disconnect)."""
    unplaced = gw.metrics.of_class(UNPLACED)
    unplaced.requests(outcome).inc()
    if outcome == "client_gone":
        unplaced.client_aborts.inc()


async def _prompt_chain(gw: Gateway, req: ChatCompletionRequest | CompletionRequest, body: dict) -> EncodedPrompt:
    """The prompt's length and prefix block keys, its tokens counted as the engine will count them.

    A chat goes through ``gw.prompt_cache``: only the messages that no earlier request of its conversation had are
    tokenized. A chat with ``tools`` is tokenized whole, the tools rendered into the template as SGLang renders them
    (:func:`laps.tokenizer.template_tools`); the engine gets them as sent. With ``continue_final_message`` the last
    (assistant) message's text is tokenized alone and follows the generation prompt, as SGLang does. ``gw.encoder``
    tokenizes by size: short texts on the event loop, longer ones off it (:class:`laps.chat_cache.EncodePool`). Token
    ids (a completion's ``prompt``, a chat's ``input_ids``, which SGLang prefills instead of the messages) are the
    prompt as they are.

    Raises:
        APIError: 400 for a token id outside the vocabulary (param ``prompt`` or ``input_ids``).
    """
    if isinstance(req, ChatCompletionRequest) and req.input_ids is None:
        lookup = gw.prompt_cache.lookup(req.chat(), template_tools(body.get("tools"), body.get("tool_choice")))
        encoded = await gw.encoder.run(lookup.new_chars, "encode", lookup)
        gw.prompt_cache.store(lookup, encoded)
        prefix = req.reply_prefix()
        if prefix is None:
            return encoded
        # continue_final_message: the reply's given start follows the generation prompt; the engine caches the prompt
        # and the reply as one sequence, so the chain is learnt as a plain prompt's (digest None)
        prompt = encoded.prompt.extend(gw.tokenizer.encode(prefix))
        return EncodedPrompt(prompt, prompt, None)
    if isinstance(req, ChatCompletionRequest):
        ids = req.input_ids
    else:
        body["prompt"] = req.prompt  # a list of one string goes on as that string
        if isinstance(req.prompt, str):
            return await gw.encoder.run(len(req.prompt), "encode_text", req.prompt)
        ids = req.prompt
    bad = next((t for t in ids if not 0 <= t < gw.tokenizer.vocab_size), None)
    if bad is not None:  # SGLang would index its embedding table with it (a crashed engine, not an error)
        param = _prompt_param(req)
        raise APIError(400, f"{param}: token id {bad} is outside the vocabulary (0 .. {gw.tokenizer.vocab_size - 1})", param=param)
    chain = BlockChain(gw.prefix_index.block_tokens).extend(ids)
    return EncodedPrompt(chain, chain, None)


def _output_hints(gw: Gateway, body: dict) -> tuple[int | None, tuple[int, ...]]:
    """The request's output cap and, under ``policy: backlog`` only (tokenizing replies costs), the token
    counts of its earlier assistant replies: what :mod:`policies.output_predictor` predicts from."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if gw.config.scheduling.policy != "backlog" or "messages" not in body:
        return max_tokens, ()
    replies = [{"role": "assistant", "content": ChatMessage.model_validate(m).text()} for m in body["messages"] if m["role"] == "assistant"]
    return max_tokens, reply_token_counts(replies, gw.tokenizer.encode)


def _deadline_s(request: web.Request, arrival_s: float) -> float | None:
    """Arrival + the ``x-laps-slo-ttft-s`` header's SLO (``none``: no deadline); ``None`` without the header (the
    configured SLO applies: :func:`gateway.dispatcher.classify`).

    Raises:
        APIError: 400 when the header is not a decimal number of seconds > 0 (ASCII, as JSON writes numbers) or
            ``none``, or is sent twice.
    """
    value = single_header(request, SLO_HEADER)
    if value is None:
        return None
    if value.strip().lower() == "none":
        return math.inf
    slo_s = float(value) if _SECONDS.fullmatch(value) else -1.0
    if not slo_s > 0 or math.isinf(slo_s):
        raise APIError(400, f"header {SLO_HEADER}: expected seconds > 0 or 'none', got {value!r}", param=SLO_HEADER)
    return arrival_s + slo_s


async def _dispatch(request: web.Request, gw: Gateway, body: dict, path: str, prompt: EncodedPrompt, stream: bool, arrival_s: float,
                    deadline_s: float | None, priority: int | None) -> web.StreamResponse:
    rid = next_request_id()
    arrival = Arrival(rid, prompt.prompt, arrival_s, deadline_s, *_output_hints(gw, body), stream=stream, priority=priority)
    guard = RequestGuard(gw.config.gateway.first_byte_timeout_s, gw.config.gateway.stall_timeout_s)
    gw.guards.add(guard)
    try:
        try:
            return await _attempt(request, gw, body, path, prompt, stream, arrival, guard, may_retry=True)
        except EngineUnavailable as err:
            # Nothing reached the client: the engine is taken out of service or probed (engine_failed; the health poll
            # brings it back) and, where the error is retryable, another tried once, under a fresh engine rid: the
            # abort of the first try may still be on its way to an engine of the retry.
            engine_failed(gw, err)
            if not err.retryable:
                raise
            retry = dataclasses.replace(arrival, rid=f"{rid}{RETRY_RID_SUFFIX}")
            log.warning("%s: engine %s failed before the first byte (%s); retrying on another engine as %s", rid, err.engine_id, err.detail, retry.rid)
            return await _attempt(request, gw, body, path, prompt, stream, retry, guard, may_retry=False)
    finally:
        gw.guards.discard(guard)


async def _attempt(request: web.Request, gw: Gateway, body: dict, path: str, prompt: EncodedPrompt, stream: bool, arrival: Arrival,
                   guard: RequestGuard, may_retry: bool) -> web.StreamResponse:
    """One try (see :func:`_dispatch`), run as a task of its own so that the client leaving does not cut it short
    once the client has its whole answer (:attr:`gateway.relay.Reply.done`): the request then ends as ``ok`` and is
    learnt from; before that, leaving aborts it (:func:`_serve_once`).
    """
    reply = Reply()
    work = asyncio.ensure_future(_serve_once(request, gw, body, path, prompt, stream, arrival, guard, reply, may_retry))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:  # the client went away (the app runs with handler_cancellation)
        if not reply.done:
            work.cancel()
        in_background(work)
        raise


async def _serve_once(request: web.Request, gw: Gateway, body: dict, path: str, prompt: EncodedPrompt, stream: bool, arrival: Arrival,
                      guard: RequestGuard, reply: Reply, may_retry: bool) -> web.StreamResponse:
    """Classify ``arrival`` and admit it to an engine, relay its answer into ``reply`` and the client's response, and
    account for it.

    An :class:`EngineUnavailable` of a try that ``may_retry`` is logged as outcome ``retried`` and not counted in
    ``laps_requests_total`` (the retry is). A request that no engine took (none healthy, the scheduler process
    unreachable, a policy failure, the gateway shutting down, its client gone while it waited to be placed) is counted
    and logged with class ``unplaced``.
    """
    with child_span(gw.tracer, "queueing") as span:
        if span is not None:
            span.set_attributes({"laps.prompt_tokens": arrival.chain.tokens, "laps.queued_ahead": gw.dispatcher.queued})
        try:
            view, engine_id = await gw.dispatcher.place(arrival)
        except (APIError, asyncio.CancelledError) as err:  # cancelled: the client went away; the dispatcher withdrew it
            outcome, why = (outcome_of(err), err.message) if isinstance(err, APIError) else ("client_gone", "left while waiting to be placed")
            _count_unplaced(gw, outcome)
            log.info("%s %s class=%s prompt_tokens=%d outcome=%s (%s) %.1f ms", arrival.rid, path, UNPLACED, arrival.chain.tokens, outcome,
                     why, 1e3 * (time.monotonic() - arrival.arrival_s))
            raise
        if span is not None:
            span.set_attributes({"laps.class": view.request_class, "laps.new_tokens": view.new_tokens, "laps.engine": engine_id})
    rid, req_class, arrival_s = view.rid, view.request_class, view.arrival_s
    engine = gw.registry[engine_id]
    body["rid"] = rid
    set_engine_priority(gw, engine_id, body, view.priority)
    cached_est = str(view.cached_by_engine.get(engine_id, 0))
    headers = {
        "x-laps-class": req_class,
        "x-laps-engine": engine_id,
        "x-request-id": rid,
        "x-laps-prompt-tokens": str(view.prompt_tokens),
        "x-laps-cached-tokens-est": cached_est,
        "x-laps-new-tokens": str(view.new_tokens),
    }
    class_metrics = gw.metrics.of_class(req_class)
    in_flight = gw.metrics.in_flight_of(engine_id)
    in_flight.inc()
    class_metrics.prompt_tokens.inc(view.prompt_tokens)
    class_metrics.cached_estimated.inc(view.cached_by_engine.get(engine_id, 0))
    if view.cached_tokens:
        class_metrics.reprefills.inc()
    outcome = "error"
    detail = ""
    try:
        if gw.pd is not None:  # prefill-decode pair: engine_id prefills, a decode engine answers
            response, outcome = await pd_dispatch.relay(request, gw, path, body, headers, view, engine_id, guard, reply, stream,
                                                        prompt.prompt.keys)
        elif stream:
            response, outcome = await _relay_stream(request, gw, engine, path, body, headers, view, guard, reply, prompt.prompt.keys)
        else:
            response, outcome = await _relay_json(gw, engine, path, body, headers, view, guard, reply, prompt.prompt.keys)
        if outcome == "ok" and reply.finish_reason == "abort":  # relayed as the engine sent it, not counted as served
            outcome = "engine_abort"
            log.warning("%s: engine %s ended the request with finish_reason abort (%d characters of reply)", rid,
                        headers.get(pd_dispatch.DECODE_ENGINE_HEADER, engine_id), sum(map(len, reply.text)))
        if outcome == "ok":
            # The client has its whole answer; learning from it must not hold (or be cancelled with) the handler.
            in_background(_learn_from_reply(gw, engine_id, view, prompt, reply, reply_cached_on_engine=gw.pd is None))
        return response
    except APIError as err:
        err.headers.update(headers)  # which class and engine failed, as on every answer
        outcome = "retried" if may_retry and isinstance(err, EngineUnavailable) and err.retryable else outcome_of(err)
        detail = f" ({err.detail})" if isinstance(err, EngineUnavailable) else ""
        raise
    except (ClientGone, asyncio.CancelledError):
        outcome = "client_gone"
        class_metrics.client_aborts.inc()
        in_background(gw.client.abort(engine.url, rid))
        decode_id = headers.get(pd_dispatch.DECODE_ENGINE_HEADER)
        log.info("%s: client went away; aborting on %s", rid, engine_id if decode_id is None else f"{engine_id} and {decode_id}")
        raise
    finally:
        gw.dispatcher.complete(view, engine_id)
        in_flight.dec()
        took_s = time.monotonic() - arrival_s
        if outcome != "retried":
            class_metrics.requests(outcome).inc()
        if outcome == "ok":
            class_metrics.e2e.observe(took_s)
        decode_id = headers.get(pd_dispatch.DECODE_ENGINE_HEADER)  # PD: the pair's decode engine, once chosen
        log.info("%s %s class=%s engine=%s%s prompt_tokens=%d cached_est=%s cached_reported=%s outcome=%s%s %.1f ms",
                 rid, path, req_class, engine_id, "" if decode_id is None else f" decode={decode_id}", view.prompt_tokens, cached_est,
                 reply.cached_tokens, outcome, detail, 1e3 * took_s)


async def _learn_from_reply(gw: Gateway, engine_id: str, view: RequestView, prompt: EncodedPrompt, reply: Reply,
                            reply_cached_on_engine: bool) -> None:
    """Correct the prefix index with the reported hit, then record the chat + reply as cached on the engine.

    The engine's radix cache keeps the generated tokens too, so the next turn of
    the conversation (whose history holds this reply) re-prefills only its new
    message; the reply is encoded as the next turn's template renders it
    (:meth:`laps.chat_cache.ChatPrefixCache.reply_chain`), and that chain is kept
    so the next turn tokenizes only its new message. A PD prefill engine never
    computes the reply (``reply_cached_on_engine`` false): the prefix index then
    learns only the prompt on it, while the chat cache still keeps the chain
    with the reply (it is about tokenizing, not about which engine caches what).
    Where the prefix index took the engine's report on the prompt already (:attr:`Reply.prompt_observed`:
    :func:`_relay_json`, or PD's prefill answer) the chain with the reply is only inserted, and in PD nothing is
    left to learn.
    """
    if reply.cached_tokens is not None:
        class_metrics = gw.metrics.of_class(view.request_class)
        class_metrics.prefix_estimate_error.observe(abs(view.cached_by_engine.get(engine_id, 0) - reply.cached_tokens))
        class_metrics.cached_reported.inc(reply.cached_tokens)
    text = "".join(reply.text)
    chain = await gw.encoder.run(len(text), "reply_chain", prompt, text)
    gw.prompt_cache.store_reply(prompt, text, chain)  # the conversation's next request will tokenize its new message only
    keys = chain.keys if reply_cached_on_engine else prompt.prompt.keys
    if not reply.prompt_observed:
        gw.prefix_index.observe(engine_id, keys, reply.cached_tokens, view.cached_by_engine.get(engine_id, 0))
    elif reply_cached_on_engine:
        gw.prefix_index.insert(engine_id, keys)


async def _relay_json(gw: Gateway, engine: EngineState, path: str, body: dict, headers: dict, view: RequestView, guard: RequestGuard,
                      reply: Reply, prompt_keys: Sequence[int]) -> tuple[web.Response, str]:
    """Relay the engine's JSON answer. Once it is in, the prompt is in the engine's prefix cache: the prefix index
    takes the engine's report on ``prompt_keys`` before the client has the answer, so that its next turn is routed
    with them (the reply's blocks are inserted afterwards, in the background: :func:`_learn_from_reply`)."""
    try:
        with guard.watching(engine, stream=False):
            async with gw.client.post(engine.url, path, body) as upstream:
                payload = await upstream.read()
                status = upstream.status
    except EngineHTTPError as err:
        failure = unreachable(engine, err)
        if isinstance(failure, AnswerTooLong):  # still running there
            in_background(gw.client.abort(engine.url, view.rid))
        raise failure from None
    except (EngineTimeout, ShuttingDown):
        # The guard cut the wait off; a request cancelled before its answer keeps its connection to the engine
        # (engines/client.py), so the engine is told to drop it.
        in_background(gw.client.abort(engine.url, view.rid))
        raise
    engine.last_byte_s = asyncio.get_running_loop().time()  # the engine is alive: it answered
    if status != 200:
        return upstream_error(engine.id, status, payload, headers), f"http_{status}"
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        raise EngineUnavailable(engine, f"answer is not a JSON object: {payload[:200]!r}")
    reply.take(obj)
    gw.prefix_index.observe(engine.id, prompt_keys, reply.cached_tokens, view.cached_by_engine.get(engine.id, 0))
    reply.prompt_observed = True
    gw.dispatcher.first_token(view.rid, engine.id, reply.cached_tokens)
    return web.Response(body=payload, status=status, content_type="application/json", headers=headers), "ok"


async def _relay_stream(request: web.Request, gw: Gateway, engine: EngineState, path: str, body: dict, headers: dict, view: RequestView,
                        guard: RequestGuard, reply: Reply, prompt_keys: Sequence[int]) -> tuple[web.StreamResponse, str]:
    """Relay the engine's stream; at its first chunk the prompt is prefilled, so it is in the engine's prefix cache
    from then on (its blocks go into the prefix index: :meth:`~policies.prefix_index.PrefixIndex.insert_prefilled`).

    Raises:
        EngineUnavailable: the engine failed before its first byte (the caller retries elsewhere once).
    """
    tap = StreamTap(reply, drop_usage=not ask_engine_for_usage(body))

    def on_first() -> None:
        gw.metrics.of_class(view.request_class).ttft.observe(time.monotonic() - view.arrival_s)
        gw.prefix_index.insert_prefilled(engine.id, prompt_keys, view.cached_by_engine.get(engine.id, 0))
        gw.dispatcher.first_token(view.rid, engine.id, None)

    sse = SSERelay(request, gw, headers, tap, guard, engine, on_first)
    try:
        with guard.watching(engine, stream=True):
            async with gw.client.post(engine.url, path, body, stream=True) as upstream:
                if upstream.status != 200:
                    return upstream_error(engine.id, upstream.status, await upstream.read(), headers), f"http_{upstream.status}"
                await sse.pump(upstream.chunks())
    except EngineHTTPError as err:
        api_error: APIError = unreachable(engine, err)
    except (EngineUnavailable, ShuttingDown) as err:
        api_error = err
    else:
        return await sse.finish(), "engine_error" if tap.engine_error else "ok"  # engine_error: its own error event
    in_background(gw.client.abort(engine.url, view.rid))
    if sse.response is None:
        raise api_error
    if isinstance(api_error, ShuttingDown):  # the engine did nothing wrong
        log.info("%s: stream to engine %s cut: the gateway is shutting down; the stream ends with an error event", view.rid, engine.id)
    else:
        log.warning("%s: engine %s failed mid-stream (%s); the stream ends with an error event", view.rid, engine.id,
                    getattr(api_error, "detail", api_error.message))
    if isinstance(api_error, EngineUnavailable):
        engine_failed(gw, api_error)
    return await sse.fail(api_error), outcome_of(api_error)


def _model_card(gw: Gateway) -> dict:
    """The served model as ``/v1/models`` lists it, with its context length as ``max_model_len`` (as SGLang lists
    it) when known."""
    card = {"id": gw.config.model.name, "object": "model", "created": 0, "owned_by": "laps"}
    if gw.context_tokens is not None:
        card["max_model_len"] = gw.context_tokens
    return card


async def list_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the one served model."""
    return web.json_response({"object": "list", "data": [_model_card(request.app[GATEWAY])]}, dumps=dumps)


async def retrieve_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: the served model's card (OpenAI's "retrieve model", which SGLang 0.5.23 serves too).

    Raises:
        APIError: 404 ``model_not_found`` for any other name.
    """
    gw = request.app[GATEWAY]
    _check_model(gw, request.match_info["model"])
    return web.json_response(_model_card(gw), dumps=dumps)


async def health(request: web.Request) -> web.Response:
    """``GET /health``: ``ok`` (200) when every engine serves, ``degraded`` (200) when some do, ``unavailable`` (503)
    when none does, ``shutting_down`` (503) once the gateway stops; with the admin key
    (``Authorization: Bearer``) also every engine's id, pool, URL, state and load."""
    gw = request.app[GATEWAY]
    serving = sum(e.serving for e in gw.registry)
    total = len(list(gw.registry))
    status = "shutting_down" if gw.closing else "ok" if serving == total else "degraded" if serving else "unavailable"
    body: dict = {"status": status, "engines_serving": serving, "engines_total": total}
    if admin_key_given(request, gw):
        body["engines"] = [{"id": e.id, "url": e.url, "pool": e.pool, "healthy": e.healthy, "stalled": e.stalled, "draining": e.draining,
                            "in_flight": e.in_flight} for e in gw.registry]
    return web.json_response(body, status=200 if status in ("ok", "degraded") else 503, dumps=dumps)


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format."""
    gw = request.app[GATEWAY]
    return web.Response(body=generate_latest(gw.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
