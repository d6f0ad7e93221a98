"""Request parsing and response shapes shared by the simulated engine's endpoints (SGLang 0.5.23's wire format).

Shapes were read from SGLang 0.5.23's ``entrypoints/http_server.py``,
``openai/serving_chat.py``, ``openai/serving_completions.py`` and
``openai/protocol.py``: errors are SGLang's flat ``ErrorResponse``
``{"object": "error", "message", "type", "param", "code"}``.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import orjson
from aiohttp import web

from engines.sim.core import RequestEvent
from engines.sim.faults import sse_response
from engines.sim.replies import IncrementalDetokenizer
from laps.tokenizer import ChatTokenizer


class ApiError(Exception):
    """A request error rendered as SGLang's flat OpenAI ``ErrorResponse``."""

    def __init__(self, message: str, err_type: str = "BadRequestError", status: int = 400) -> None:
        super().__init__(message)
        self.message, self.err_type, self.status = message, err_type, status


def json_response(obj: Any, status: int = 200) -> web.Response:
    """``obj`` as a JSON response (orjson)."""
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error_body(err: ApiError) -> dict[str, Any]:
    """SGLang's flat OpenAI error body: ``{"object": "error", "message", "type", "param", "code"}``."""
    return {"object": "error", "message": err.message, "type": err.err_type, "param": None, "code": err.status}


@web.middleware
async def errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Render an :class:`ApiError` raised by a handler as its JSON error body."""
    try:
        return await handler(request)
    except ApiError as err:
        return json_response(error_body(err), err.status)


async def read_body(request: web.Request, openai: bool) -> dict[str, Any]:
    """The request's JSON object; OpenAI routes also require ``Content-Type: application/json``.

    Raises:
        ApiError: wrong content type, invalid JSON or not an object.
    """
    if openai and request.content_type != "application/json":
        raise ApiError("Unsupported Media Type: Only 'application/json' is allowed", "Bad Request")
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as err:
        raise ApiError(f"JSON decode error: {err}", "Bad Request") from err
    if not isinstance(body, dict):
        raise ApiError("Input should be a valid dictionary or object", "Bad Request")
    return body


def field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    """``body[name]`` checked against ``kinds`` (a bool is never an int); ``default`` when absent or null.

    Raises:
        ApiError: the value has another type.
    """
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ApiError(f"{name}: Input should be a valid {names}", "Bad Request")
    return value


def stop_list(body: dict[str, Any]) -> list[str]:
    """The ``stop`` strings of ``body`` (a string or a list of strings) as a list.

    Raises:
        ApiError: ``stop`` is neither.
    """
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise ApiError("stop: Input should be a valid string or list of strings", "Bad Request")


def request_id(body: dict[str, Any]) -> str:
    """The client's ``rid``, or a fresh random one."""
    return field(body, "rid", (str,)) or uuid.uuid4().hex


# ---- reply text --------------------------------------------------------------------------------


class ReplyText:
    """The reply text a client may see so far: stop strings cut, partial ones held back."""

    def __init__(self, tokenizer: ChatTokenizer, stop: list[str]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = stop
        self.output_ids: list[int] = []

    def add(self, ev: RequestEvent) -> str:
        """Take ``ev``'s tokens; return the visible text (final once ``ev`` is finished)."""
        self.output_ids.extend(ev.new_token_ids)
        self._detok.add(ev.new_token_ids)
        if ev.finished:
            text = self._detok.flush()
            if isinstance(ev.matched_stop, str):
                text = text[: text.find(ev.matched_stop)]
            return text
        text = self._detok.text
        hold = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[: len(text) - hold]


def finish_reason_dict(ev: RequestEvent) -> dict[str, Any] | None:
    """``meta_info.finish_reason`` of the native API for ``ev`` (None while running)."""
    if ev.finish_reason == "stop":
        return {"type": "stop", "matched": ev.matched_stop}
    if ev.finish_reason == "length":
        return {"type": "length", "length": ev.completion_tokens}
    if ev.finish_reason == "abort":
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    return None


def usage(ev: RequestEvent, cache_report: bool) -> dict[str, Any]:
    """The OpenAI ``usage`` object; ``prompt_tokens_details.cached_tokens`` only with ``cache_report``."""
    return {
        "prompt_tokens": ev.prompt_tokens,
        "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        "completion_tokens": ev.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": ev.cached_tokens} if cache_report else None,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def open_sse(request: web.Request) -> web.StreamResponse:
    """Start an SSE response (one that fails as ``--sim-fault`` says, :mod:`engines.sim.faults`)."""
    resp = sse_response(request, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


# ---- logprobs ------------------------------------------------------------------------------------

SIM_TOKEN_LOGPROB = -0.25  # the simulated engine's log-probability of every token it picks; alternative k: -(k + 1)


def logprob_request(body: dict[str, Any], chat: bool, vocab_size: int) -> int | None:
    """How many top alternatives per token the request asks for, or None for no logprobs: chat ``logprobs: true``
    with ``top_logprobs`` (0..20), completions ``logprobs: N`` (0..``vocab_size``: SGLang sets no upper bound, and
    this engine lists that many alternatives of each token).

    Raises:
        ApiError: a value of the wrong type or out of range.
    """
    if chat:
        if not field(body, "logprobs", (bool,), False):
            return None
        top = field(body, "top_logprobs", (int,), 0)
        if not 0 <= top <= 20:
            raise ApiError(f"top_logprobs must be between 0 and 20, got {top}", "Bad Request")
        return top
    top = field(body, "logprobs", (int,))
    if top is not None and top < 0:
        raise ApiError(f"logprobs must be at least 0, got {top}", "Bad Request")
    if top is not None and top > vocab_size:
        raise ApiError(f"logprobs must be at most the vocabulary size ({vocab_size}), got {top}", "Bad Request")
    return top


def _alternatives(tokenizer: ChatTokenizer, token_id: int, top: int) -> list[tuple[str, float]]:
    """The picked token and ``top - 1`` others (the next ids), with their simulated log-probabilities."""
    ids = [token_id] + [(token_id + k) % tokenizer.vocab_size for k in range(1, top)]
    return [(tokenizer.decode([t]), SIM_TOKEN_LOGPROB if k == 0 else -(k + 1.0)) for k, t in enumerate(ids)]


def chat_logprobs(tokenizer: ChatTokenizer, token_ids: list[int], top: int) -> dict[str, Any]:
    """OpenAI chat ``choices[].logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``."""
    content = []
    for t in token_ids:
        alts = _alternatives(tokenizer, t, max(top, 1))
        token, logprob = alts[0]
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()),
                        "top_logprobs": [{"token": a, "logprob": lp, "bytes": list(a.encode())} for a, lp in alts[:top]]})
    return {"content": content}


def completion_logprobs(tokenizer: ChatTokenizer, token_ids: list[int], top: int, text_offset: int) -> dict[str, Any]:
    """OpenAI completions ``choices[].logprobs``: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for t in token_ids:
        alts = _alternatives(tokenizer, t, max(top, 1))
        tokens.append(alts[0][0])
        token_logprobs.append(alts[0][1])
        tops.append(dict(alts[:top]))
        offsets.append(text_offset)
        text_offset += len(alts[0][0])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


# (OpenAI field, SGLang sampling parameter, accepted types); SGLang 0.5.23 `openai/protocol.py` maps them in
# `to_sampling_params` (`min_tokens` -> `min_new_tokens`, `seed` -> `sampling_seed`).
_SAMPLING_FIELDS = (
    ("temperature", "temperature", (int, float)), ("top_p", "top_p", (int, float)), ("top_k", "top_k", (int,)),
    ("min_p", "min_p", (int, float)), ("frequency_penalty", "frequency_penalty", (int, float)),
    ("presence_penalty", "presence_penalty", (int, float)),
    ("repetition_penalty", "repetition_penalty", (int, float)), ("min_tokens", "min_new_tokens", (int,)),
    ("seed", "sampling_seed", (int,)),
)


def check_sampling(body: dict[str, Any], openai: bool, max_new_tokens: int | None) -> None:
    """Reject sampling values SGLang 0.5.23 rejects (``SamplingParams.verify`` in ``sampling/sampling_params.py``):
    the simulated engine samples nothing, but a request real SGLang refuses must be refused here too. ``body`` is an
    OpenAI request (``openai``) or ``/generate``'s ``sampling_params``; null or absent fields take SGLang's defaults;
    ``max_new_tokens`` is the request's reply limit (``None``: none), which ``min_tokens`` may not exceed.

    Raises:
        ApiError: a field of the wrong type, or out of SGLang's range (SGLang's message).
    """
    values = {}
    for openai_name, name, kinds in _SAMPLING_FIELDS:
        values[name] = field(body, openai_name if openai else name, kinds)
    checks = (
        ("temperature", lambda v: math.isfinite(v) and v >= 0, "must be a non-negative finite number"),
        ("top_p", lambda v: 0 < v <= 1, "must be in (0, 1]"),
        ("min_p", lambda v: 0 <= v <= 1, "must be in [0, 1]"),
        ("top_k", lambda v: v == -1 or v >= 1, "must be -1 (disable) or at least 1"),
        ("frequency_penalty", lambda v: -2 <= v <= 2, "must be in [-2, 2]"),
        ("presence_penalty", lambda v: -2 <= v <= 2, "must be in [-2, 2]"),
        ("repetition_penalty", lambda v: 0 < v <= 2, "must be in (0, 2] (1.0 = no penalty)"),
        ("min_new_tokens", lambda v: v >= 0, "must be at least 0"),
        ("sampling_seed", lambda v: -(2**63) <= v <= 2**63 - 1, "must be in [-2**63, 2**63 - 1]"),
    )
    for name, ok, rule in checks:
        if values[name] is not None and not ok(values[name]):
            raise ApiError(f"{name} {rule}, got {values[name]}.")
    least = values["min_new_tokens"]
    if least is not None and max_new_tokens is not None and least > max_new_tokens:
        raise ApiError(f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], got {least}.")
