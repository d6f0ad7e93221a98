"""The simulated engine's OpenAI endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions``.

Responses are SGLang 0.5.23's (``openai/serving_chat.py``,
``openai/serving_completions.py``): JSON or SSE chunks, ``usage`` with
``prompt_tokens_details.cached_tokens`` under ``--enable-cache-report``, the
SGLang extensions ``rid``, ``ignore_eos``, ``priority`` and ``matched_stop``.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from engines.sim.core import RequestEvent
from engines.sim.faults import answer as faulty_answer
from engines.sim.protocol import (
    ApiError,
    ReplyText,
    chat_logprobs,
    check_sampling,
    completion_logprobs,
    field,
    logprob_request,
    json_response,
    open_sse,
    read_body,
    request_id,
    sse,
    stop_list,
    usage,
)
from engines.sim.realtime import ENGINE, SimEngine, Track
from laps.tokenizer import ChatTokenizer, final_assistant_message, template_tool_calls, template_tools

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # SGLang CompletionRequest default


def _submit(engine: SimEngine, body: dict[str, Any], rid: str, ids: list[int], max_new: int | None,
            ignore_eos: bool, stop: list[str]) -> Track:
    priority = field(body, "priority", (int,))
    try:
        if engine.pd is not None:  # a PD engine: the bootstrap fields say where the KV comes from or goes
            return engine.pd.submit(rid, body, ids, max_new, ignore_eos, stop, priority)
        return engine.submit(rid, ids, max_new, ignore_eos, stop, priority)
    except ValueError as err:
        raise ApiError(str(err)) from err


def _chat_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The messages as SGLang 0.5.23 hands them to the chat template, and the text the prompt ends with after the
    generation prompt (``continue_final_message``: :func:`laps.tokenizer.final_assistant_message`)."""
    if "messages" not in body:
        raise ApiError("messages: Field required", "Bad Request")
    raw = body["messages"]
    if not isinstance(raw, list):
        raise ApiError("messages: Input should be a valid list", "Bad Request")
    if not raw:
        raise ApiError("Messages cannot be empty.")
    out = []
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError("messages: each message needs a string 'role'", "Bad Request")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = [p.get("text", "") if isinstance(p, dict) else p for p in content
                     if isinstance(p, str) or (isinstance(p, dict) and p.get("type") == "text")]
            content = " ".join(parts)
        elif not isinstance(content, str):
            raise ApiError("messages: content should be a string or a list of text parts", "Bad Request")
        message = {"role": m["role"], "content": content}
        calls = m.get("tool_calls")
        if calls and m["role"] == "assistant":
            if not (isinstance(calls, list) and all(map(_is_tool_call, calls))):
                raise ApiError('messages: tool_calls: a list of {"id": str, "type": "function", "function": {"name": str, '
                               '"arguments": str or object}}', "Bad Request")
            try:
                message["tool_calls"] = template_tool_calls(calls)
            except ValueError as err:  # arguments that are not a JSON object
                raise ApiError(str(err)) from err
        out.append(message)
    return final_assistant_message(out, field(body, "continue_final_message", (bool,), False) is True)


def _is_tool_call(call: object) -> bool:
    """Whether ``call`` has the types of SGLang 0.5.23's ``ToolCall`` (``protocol.py``: every field optional but
    ``function``)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return False
    function = call["function"]
    return (isinstance(call.get("id"), (str, type(None))) and call.get("type", "function") == "function"
            and isinstance(function.get("name"), (str, type(None))) and isinstance(function.get("arguments"), (str, dict, type(None))))


def _max_new_tokens(value: int | None, engine: SimEngine) -> int | None:
    """Check a requested reply length as SGLang does (None: up to the context length)."""
    if value is None:
        return None
    if value < 0:
        raise ApiError(f"max_new_tokens must be at least 0, got {value}.")
    context = engine.sim.config.context_length
    if value > context:
        raise ApiError(f"max_completion_tokens is too large: {value}.This model supports at most {context} "
                       f"completion tokens.")
    return value


def _options(body: dict[str, Any], max_new: int | None) -> tuple[list[str], bool, bool, bool, str, str]:
    """The request options both OpenAI routes read: stop strings, ``ignore_eos``, ``stream``, whether the
    client asked for usage in the stream, the model name and the request id (``max_new``: its reply limit).

    Raises:
        ApiError: a field of the wrong type, a sampling value SGLang refuses (:func:`check_sampling`), or ``n`` other
            than 1 (SGLang answers ``n`` choices; this engine answers one, and says so rather than answer fewer).
    """
    check_sampling(body, openai=True, max_new_tokens=max_new)
    if field(body, "n", (int,), 1) != 1:
        raise ApiError(f"n must be 1 on the simulated engine (it answers one choice), got {body['n']}", "Bad Request")
    include_usage = bool((field(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
    return (stop_list(body), bool(field(body, "ignore_eos", (bool,), False)), bool(field(body, "stream", (bool,), False)),
            include_usage, field(body, "model", (str,), "default"), request_id(body))


async def _whole_answer(track: Track, reply: ReplyText) -> tuple[str, RequestEvent]:
    """Wait for a non-streamed request to finish: its text and its last event."""
    last = None
    async for last in track.events():
        text = reply.add(last)
    assert last is not None
    return text, last


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``: OpenAI chat, streamed (SSE) or not."""
    engine = request.app[ENGINE]
    body = await read_body(request, openai=True)
    messages, reply_prefix = _chat_messages(body)
    # SGLang takes `max_completion_tokens or max_tokens`, so 0 means "no limit" here.
    max_new = _max_new_tokens(field(body, "max_completion_tokens", (int,)) or field(body, "max_tokens", (int,)),
                              engine)
    stop, ignore_eos, stream, include_usage, model, rid = _options(body, max_new)
    top = logprob_request(body, chat=True, vocab_size=engine.tokenizer.vocab_size)
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)):
        raise ApiError("tools: a list of {\"type\": \"function\", \"function\": {...}}", "Bad Request")
    ids = body.get("input_ids")  # SGLang's extension: the prompt's ids, prefilled instead of the rendered messages
    if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise ApiError("input_ids: Input should be a valid list of token ids", "Bad Request")
    if ids is None:
        try:
            ids = engine.tokenizer.encode_chat(messages, template_tools(tools, body.get("tool_choice")))
        except Exception as err:  # an HF chat template can raise anything on odd messages
            raise ApiError(f"cannot apply the chat template: {err}") from err
        if reply_prefix:
            ids += engine.tokenizer.encode(reply_prefix)
    track = _submit(engine, body, rid, ids, max_new, ignore_eos, stop)
    created = int(time.time())
    cache_report = engine.sim.args.enable_cache_report
    reply = ReplyText(engine.tokenizer, stop)
    try:
        if not stream:
            text, last = await _whole_answer(track, reply)
            return await faulty_answer(request, json_response({
                "id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "reasoning_content": None},
                    "logprobs": None if top is None else chat_logprobs(engine.tokenizer, reply.output_ids, top),
                    "finish_reason": last.finish_reason, "matched_stop": last.matched_stop,
                }],
                "usage": usage(last, cache_report),
                "metadata": {"weight_version": "default"},
            }))
        resp = await open_sse(request)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        sent = 0
        started = False
        unsent_ids: list[int] = []  # tokens whose text has not gone out yet (held back by a partial stop string)
        async for ev in track.events():
            if not started:
                started = True
                await resp.write(sse({**head, "choices": [{
                    "index": 0, "delta": {"reasoning_content": None, "role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None, "matched_stop": None}]}))
            text = reply.add(ev)
            unsent_ids.extend(ev.new_token_ids)
            if len(text) > sent:
                logprobs = None if top is None else chat_logprobs(engine.tokenizer, unsent_ids, top)
                await resp.write(sse({**head, "choices": [{
                    "index": 0, "delta": {"reasoning_content": None, "content": text[sent:]},
                    "logprobs": logprobs, "finish_reason": None, "matched_stop": None}]}))
                sent = len(text)
                unsent_ids = []
            if ev.finished:
                await resp.write(sse({**head, "choices": [{
                    "index": 0, "delta": {"reasoning_content": None},
                    "logprobs": None, "finish_reason": ev.finish_reason, "matched_stop": ev.matched_stop}]}))
                if include_usage:
                    await resp.write(sse({**head, "choices": [], "usage": usage(ev, cache_report)}))
        await resp.write(b"data: [DONE]\n\n")
        return resp
    finally:
        engine.release(rid)


def _completion_prompt(body: dict[str, Any], tokenizer: ChatTokenizer) -> list[int]:
    if "prompt" not in body:
        raise ApiError("prompt: Field required", "Bad Request")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("Prompt cannot be empty")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise ApiError("Prompt cannot be empty")
        return list(prompt)
    raise ApiError("prompt: a string or a list of token ids (batches are not simulated)", "Bad Request")


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``: OpenAI text completion, streamed (SSE) or not."""
    engine = request.app[ENGINE]
    body = await read_body(request, openai=True)
    ids = _completion_prompt(body, engine.tokenizer)
    max_tokens = field(body, "max_tokens", (int,), COMPLETIONS_DEFAULT_MAX_TOKENS)
    if max_tokens <= 0:
        raise ApiError("max_tokens: Value error, max_tokens must be positive", "Bad Request")
    max_new = _max_new_tokens(max_tokens, engine)
    stop, ignore_eos, stream, include_usage, model, rid = _options(body, max_new)
    top = logprob_request(body, chat=False, vocab_size=engine.tokenizer.vocab_size)
    if field(body, "echo", (bool,), False):  # SGLang puts the prompt before the reply; this engine answers the reply
        raise ApiError("echo must be false on the simulated engine (it answers the reply alone)", "Bad Request")
    track = _submit(engine, body, rid, ids, max_new, ignore_eos, stop)
    created = int(time.time())
    cache_report = engine.sim.args.enable_cache_report
    reply = ReplyText(engine.tokenizer, stop)
    try:
        if not stream:
            text, last = await _whole_answer(track, reply)
            return await faulty_answer(request, json_response({
                "id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text,
                             "logprobs": None if top is None else completion_logprobs(engine.tokenizer, reply.output_ids, top, 0),
                             "finish_reason": last.finish_reason, "matched_stop": last.matched_stop}],
                "usage": usage(last, cache_report),
                "metadata": {"weight_version": "default"},
            }))
        resp = await open_sse(request)
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        sent = 0
        unsent_ids = []
        async for ev in track.events():
            text = reply.add(ev)
            unsent_ids.extend(ev.new_token_ids)
            if len(text) > sent or ev.finished:
                logprobs = None if top is None else completion_logprobs(engine.tokenizer, unsent_ids, top, sent)
                await resp.write(sse({**head, "choices": [{
                    "index": 0, "text": text[sent:], "logprobs": logprobs, "finish_reason": ev.finish_reason,
                    "matched_stop": ev.matched_stop}], "usage": None}))
                sent = len(text)
                unsent_ids = []
            if ev.finished and include_usage:
                final_usage = {k: v for k, v in usage(ev, cache_report).items() if v is not None}
                await resp.write(sse({**head, "choices": [], "usage": final_usage}))
        await resp.write(b"data: [DONE]\n\n")
        return resp
    finally:
        engine.release(rid)

