"""HTTP shell of the simulated engine: SGLang 0.5.23's HTTP API over :class:`~engines.sim.core.EngineCore` in real time.

One background task drives the core: ``result = core.step(now)``, sleep until
the forward pass would end, then hand each event to its request's queue; with
no work it waits on an :class:`asyncio.Event`. Back-to-back passes are laid on
one timeline (a pass starts where the previous one ended, unless the loop fell
more than :data:`MAX_LAG_S` behind), so timer granularity (uvloop: 1 ms) adds
jitter to deliveries but no drift. The clock is :func:`time.monotonic`. Handlers tokenize, submit,
and turn events into SGLang-shaped responses (shapes read from SGLang 0.5.23's
``entrypoints/http_server.py``, ``openai/serving_chat.py``,
``openai/serving_completions.py``, ``openai/protocol.py``, ``v1_loads.py``):

* ``POST /v1/chat/completions``, ``POST /v1/completions`` (OpenAI, SSE or JSON);
  errors are SGLang's flat ``ErrorResponse``:
  ``{"object": "error", "message", "type", "param", "code"}``;
* ``POST /generate`` (cumulative ``text`` and ``output_ids`` per SSE chunk);
* ``GET /v1/models``, ``/model_info``, ``/server_info``, ``/v1/loads``, ``/ready``,
  ``/health`` (a 1-token generation), ``/metrics`` (with ``--enable-metrics``);
  ``POST /abort_request``, ``/flush_cache``.

A client that disconnects aborts its request (counted in
``sglang:num_aborted_requests_total``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator, Iterable

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engines.sim.core import EngineConfig, EngineCore, RequestEvent, default_max_running_requests
from engines.sim.latency import MODELS, LatencyModel, make_latency_model
from engines.sim.replies import IncrementalDetokenizer
from laps.tokenizer import ChatTokenizer, load_tokenizer

log = logging.getLogger("engines.sim")

SGLANG_VERSION = "0.5.23"
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
HEALTH_CHECK_TIMEOUT_S = 20.0
DEFAULT_MEM_FRACTION_STATIC = 0.88
DEFAULT_CHUNKED_PREFILL_SIZE = 8192  # SGLang's choice for 80–160 GB GPUs
DEFAULT_CUDA_GRAPH_MAX_BS_DECODE = 256
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang SamplingParams default
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # SGLang CompletionRequest default
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60)
MAX_LAG_S = 0.002  # a pass starting later than this after the previous one's end restarts the timeline
FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n")


@dataclass(frozen=True, slots=True)
class SimServerArgs:
    """The engine's command line (SGLang flag names, underscores), with SGLang's defaults.

    None means "derive as SGLang does": ``chunked_prefill_size`` 8192 (−1
    disables chunking), ``max_total_tokens`` from GPU memory ·
    ``mem_fraction_static`` (0.88) minus weights, ``max_running_requests`` from
    the pool, ``context_length`` from the model, ``cuda_graph_max_bs_decode`` 256,
    ``sim_model`` from the size in ``model_path`` (7b/14b/32b, else 7b).
    """

    model_path: str = "Qwen/Qwen2.5-7B-Instruct"
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int = 16384
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    context_length: int | None = None
    schedule_policy: str = "fcfs"
    cuda_graph_max_bs_decode: int | None = None
    disable_cuda_graph: bool = False
    enable_mixed_chunk: bool = False
    enable_metrics: bool = False
    enable_cache_report: bool = False
    sim_model: str | None = None
    sim_gpu: str = "h200"
    log_level: str = "info"


@dataclass(frozen=True, slots=True)
class ResolvedSim:
    """The args with every derived default filled in, and the objects they build."""

    args: SimServerArgs
    sim_model: str
    served_model_name: str
    tokenizer_path: str | None
    mem_fraction_static: float
    cuda_graph_max_bs_decode: int
    latency: LatencyModel
    config: EngineConfig


def resolve_args(args: SimServerArgs) -> ResolvedSim:
    """Fill in derived defaults (see :class:`SimServerArgs`).

    Raises:
        ValueError: on a schedule policy other than fcfs, an unknown preset, or limits that don't fit.
    """
    if args.schedule_policy != "fcfs":
        raise ValueError(f"--schedule-policy {args.schedule_policy}: the simulated engine implements only fcfs")
    sim_model = args.sim_model or next(
        (name for name in MODELS if name.split("-")[-1] in args.model_path.lower()), "qwen2.5-7b")
    graph_bs = args.cuda_graph_max_bs_decode or DEFAULT_CUDA_GRAPH_MAX_BS_DECODE
    latency = make_latency_model(sim_model, args.sim_gpu, args.tp_size, graph_bs, args.disable_cuda_graph)
    mfs = args.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
    max_total = args.max_total_tokens or latency.max_total_tokens(mfs)
    context = args.context_length or latency.model.context_length
    chunk = args.chunked_prefill_size or DEFAULT_CHUNKED_PREFILL_SIZE
    config = EngineConfig(
        max_total_tokens=max_total,
        max_running_requests=args.max_running_requests or default_max_running_requests(max_total, context),
        chunked_prefill_size=None if chunk < 0 else chunk,
        max_prefill_tokens=args.max_prefill_tokens,
        context_length=context,
        enable_mixed_chunk=args.enable_mixed_chunk,
    )
    tokenizer_path = args.tokenizer_path or (args.model_path if Path(args.model_path).is_dir() else None)
    return ResolvedSim(args, sim_model, args.served_model_name or args.model_path, tokenizer_path, mfs, graph_bs,
                       latency, config)


class _Metrics:
    """SGLang's Prometheus metrics in a registry of their own."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Any:
            return Histogram(name, doc, labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = counter("sglang:cached_tokens", "Number of cached prompt tokens.")
        self.num_requests = counter("sglang:num_requests", "The number of requests finished.")
        self.num_aborted_requests = counter("sglang:num_aborted_requests", "Number of requests aborted.")
        self.ttft = histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.")
        self.e2e = histogram("sglang:e2e_request_latency_seconds", "Histogram of end-to-end request latency.")
        self.queue_time = histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.")


@dataclass(slots=True)
class _Track:
    """A submitted request on the HTTP side."""

    queue: asyncio.Queue[RequestEvent]
    arrival: float
    internal: bool
    first_token_at: float | None = None
    done: bool = False


class SimEngine:
    """The running engine: core, forward-pass loop, request queues, metrics."""

    def __init__(self, sim: ResolvedSim, tokenizer: ChatTokenizer) -> None:
        self.sim = sim
        self.tokenizer = tokenizer
        self.core = EngineCore(sim.config, sim.latency, tokenizer)
        self.metrics = _Metrics(sim.served_model_name)
        self.ready = False
        self.startup_time = time.time()
        self.clock = time.monotonic
        self._tracks: dict[str, _Track] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the forward-pass loop."""
        self._task = asyncio.create_task(self._run(), name="sim-engine-loop")
        self.ready = True

    async def stop(self) -> None:
        """Stop the loop; unfinished requests end with ``abort``."""
        self.ready = False
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._deliver(self.core.abort_all())

    def submit(self, rid: str, input_ids: list[int], max_new_tokens: int | None, ignore_eos: bool,
               stop: list[str]) -> _Track:
        """Queue a request; its events arrive on the returned track's queue.

        Raises:
            ValueError: as :meth:`EngineCore.add_request` (bad lengths, duplicate rid).
        """
        if rid in self._tracks:
            raise ValueError(f"Duplicate request ID: {rid}")
        now = self.clock()
        self.core.add_request(rid, input_ids, max_new_tokens, ignore_eos, stop, now)
        track = _Track(asyncio.Queue(), now, rid.startswith(HEALTH_CHECK_RID_PREFIX))
        self._tracks[rid] = track
        self._wake.set()
        return track

    def abort(self, rid: str) -> bool:
        """Abort ``rid`` (its stream ends with ``abort``); False when it is not running here."""
        event = self.core.abort(rid)
        if event is None:
            return False
        self._deliver([event])
        return True

    def abort_all(self) -> None:
        """Abort every request."""
        self._deliver(self.core.abort_all())

    def release(self, rid: str) -> None:
        """The handler of ``rid`` is done: abort it if unfinished (client gone) and forget it."""
        track = self._tracks.get(rid)
        if track is not None and not track.done:
            self.abort(rid)
        self._tracks.pop(rid, None)

    async def _run(self) -> None:
        planned: float | None = None  # where the previous pass ended on the timeline
        while True:
            if not self.core.has_work():
                self._wake.clear()
                await self._wake.wait()
                planned = None
                continue
            now = self.clock()
            start = planned if planned is not None and now - planned <= MAX_LAG_S else now
            result = self.core.step(start)
            if result.idle:  # nothing schedulable; an abort it made (if any) may free room
                self._deliver(result.events)
                if not result.events:
                    self._wake.clear()
                    await self._wake.wait()
                planned = None
                continue
            planned = start + result.duration_s
            await asyncio.sleep(max(0.0, planned - self.clock()))
            self._deliver(result.events)

    def _deliver(self, events: Iterable[RequestEvent]) -> None:
        now = self.clock()
        m = self.metrics
        for ev in events:
            track = self._tracks.get(ev.rid)
            if track is None or track.done:
                continue
            if ev.first_token:
                track.first_token_at = now
                if not track.internal:
                    m.ttft.observe(now - track.arrival)
                    if ev.queue_time_s is not None:
                        m.queue_time.observe(ev.queue_time_s)
            if not track.internal:
                m.generation_tokens.inc(len(ev.new_token_ids))
            if ev.finished:
                track.done = True
                if not track.internal:
                    self._account_finish(ev, track, now)
            track.queue.put_nowait(ev)

    def _account_finish(self, ev: RequestEvent, track: _Track, now: float) -> None:
        m = self.metrics
        m.num_requests.inc()
        m.prompt_tokens.inc(ev.prompt_tokens)
        m.cached_tokens.inc(ev.cached_tokens)
        m.e2e.observe(now - track.arrival)
        if ev.finish_reason == "abort":
            m.num_aborted_requests.inc()
        ttft = f"{(track.first_token_at - track.arrival) * 1e3:.1f}ms" if track.first_token_at else "-"
        log.info("finish rid=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d ttft=%s e2e=%.1fms reason=%s",
                 ev.rid, ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens, ttft,
                 (now - track.arrival) * 1e3, ev.finish_reason)

    def update_gauges(self) -> None:
        """Copy the core's load snapshot into the gauges (at scrape time)."""
        s = self.core.stats()
        m = self.metrics
        m.num_running_reqs.set(s.num_running_reqs)
        m.num_queue_reqs.set(s.num_waiting_reqs)
        m.num_used_tokens.set(s.num_used_tokens)
        m.token_usage.set(s.token_usage)
        m.cache_hit_rate.set(s.cache_hit_rate)
        m.gen_throughput.set(s.gen_throughput)


ENGINE = web.AppKey("engine", SimEngine)


# ---- errors and JSON -------------------------------------------------------------------------


class ApiError(Exception):
    """A request error rendered as SGLang's flat OpenAI ``ErrorResponse``."""

    def __init__(self, message: str, err_type: str = "BadRequestError", status: int = 400) -> None:
        super().__init__(message)
        self.message, self.err_type, self.status = message, err_type, status


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def _error_body(err: ApiError) -> dict[str, Any]:
    return {"object": "error", "message": err.message, "type": err.err_type, "param": None, "code": err.status}


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return _json(_error_body(err), err.status)


async def _body(request: web.Request, openai: bool) -> dict[str, Any]:
    if openai and request.content_type != "application/json":
        raise ApiError("Unsupported Media Type: Only 'application/json' is allowed", "Bad Request")
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as err:
        raise ApiError(f"JSON decode error: {err}", "Bad Request") from err
    if not isinstance(body, dict):
        raise ApiError("Input should be a valid dictionary or object", "Bad Request")
    return body


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ApiError(f"{name}: Input should be a valid {names}", "Bad Request")
    return value


def _stop_list(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise ApiError("stop: Input should be a valid string or list of strings", "Bad Request")


def _rid(body: dict[str, Any]) -> str:
    return _field(body, "rid", (str,)) or uuid.uuid4().hex


# ---- reply text --------------------------------------------------------------------------------


class _ReplyText:
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


def _finish_reason_dict(ev: RequestEvent) -> dict[str, Any] | None:
    if ev.finish_reason == "stop":
        return {"type": "stop", "matched": ev.matched_stop}
    if ev.finish_reason == "length":
        return {"type": "length", "length": ev.completion_tokens}
    if ev.finish_reason == "abort":
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    return None


def _usage(ev: RequestEvent, cache_report: bool) -> dict[str, Any]:
    return {
        "prompt_tokens": ev.prompt_tokens,
        "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        "completion_tokens": ev.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": ev.cached_tokens} if cache_report else None,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _events(track: _Track) -> AsyncIterator[RequestEvent]:
    while True:
        ev = await track.queue.get()
        yield ev
        if ev.finished:
            return


def _submit(engine: SimEngine, rid: str, ids: list[int], max_new: int | None, ignore_eos: bool,
            stop: list[str]) -> _Track:
    try:
        return engine.submit(rid, ids, max_new, ignore_eos, stop)
    except ValueError as err:
        raise ApiError(str(err)) from err


# ---- OpenAI endpoints --------------------------------------------------------------------------


def _chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
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
        out.append({"role": m["role"], "content": content})
    return out


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


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``: OpenAI chat, streamed (SSE) or not."""
    engine = request.app[ENGINE]
    body = await _body(request, openai=True)
    messages = _chat_messages(body)
    # SGLang takes `max_completion_tokens or max_tokens`, so 0 means "no limit" here.
    max_new = _max_new_tokens(_field(body, "max_completion_tokens", (int,)) or _field(body, "max_tokens", (int,)),
                              engine)
    stop = _stop_list(body)
    ignore_eos = bool(_field(body, "ignore_eos", (bool,), False))
    stream = bool(_field(body, "stream", (bool,), False))
    include_usage = bool((_field(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
    model = _field(body, "model", (str,), "default")
    rid = _rid(body)
    try:
        ids = engine.tokenizer.encode_chat(messages)
    except Exception as err:  # an HF chat template can raise anything on odd messages
        raise ApiError(f"cannot apply the chat template: {err}") from err
    track = _submit(engine, rid, ids, max_new, ignore_eos, stop)
    created = int(time.time())
    cache_report = engine.sim.args.enable_cache_report
    reply = _ReplyText(engine.tokenizer, stop)
    try:
        if not stream:
            last = None
            async for last in _events(track):
                text = reply.add(last)
            assert last is not None
            return _json({
                "id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "reasoning_content": None},
                    "logprobs": None, "finish_reason": last.finish_reason, "matched_stop": last.matched_stop,
                }],
                "usage": _usage(last, cache_report),
                "metadata": {"weight_version": "default"},
            })
        resp = await _open_sse(request)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        sent = 0
        started = False
        async for ev in _events(track):
            if not started:
                started = True
                await resp.write(_sse({**head, "choices": [{
                    "index": 0, "delta": {"reasoning_content": None, "role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None, "matched_stop": None}]}))
            text = reply.add(ev)
            if len(text) > sent:
                await resp.write(_sse({**head, "choices": [{
                    "index": 0, "delta": {"reasoning_content": None, "content": text[sent:]},
                    "logprobs": None, "finish_reason": None, "matched_stop": None}]}))
                sent = len(text)
            if ev.finished:
                await resp.write(_sse({**head, "choices": [{
                    "index": 0, "delta": {"reasoning_content": None},
                    "logprobs": None, "finish_reason": ev.finish_reason, "matched_stop": ev.matched_stop}]}))
                if include_usage:
                    await resp.write(_sse({**head, "choices": [], "usage": _usage(ev, cache_report)}))
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
    body = await _body(request, openai=True)
    ids = _completion_prompt(body, engine.tokenizer)
    max_tokens = _field(body, "max_tokens", (int,), COMPLETIONS_DEFAULT_MAX_TOKENS)
    if max_tokens <= 0:
        raise ApiError("max_tokens: Value error, max_tokens must be positive", "Bad Request")
    max_new = _max_new_tokens(max_tokens, engine)
    stop = _stop_list(body)
    ignore_eos = bool(_field(body, "ignore_eos", (bool,), False))
    stream = bool(_field(body, "stream", (bool,), False))
    include_usage = bool((_field(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
    model = _field(body, "model", (str,), "default")
    rid = _rid(body)
    track = _submit(engine, rid, ids, max_new, ignore_eos, stop)
    created = int(time.time())
    cache_report = engine.sim.args.enable_cache_report
    reply = _ReplyText(engine.tokenizer, stop)
    try:
        if not stream:
            last = None
            async for last in _events(track):
                text = reply.add(last)
            assert last is not None
            return _json({
                "id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason,
                             "matched_stop": last.matched_stop}],
                "usage": _usage(last, cache_report),
                "metadata": {"weight_version": "default"},
            })
        resp = await _open_sse(request)
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        sent = 0
        async for ev in _events(track):
            text = reply.add(ev)
            if len(text) > sent or ev.finished:
                await resp.write(_sse({**head, "choices": [{
                    "index": 0, "text": text[sent:], "logprobs": None, "finish_reason": ev.finish_reason,
                    "matched_stop": ev.matched_stop}], "usage": None}))
                sent = len(text)
            if ev.finished and include_usage:
                usage = {k: v for k, v in _usage(ev, cache_report).items() if v is not None}
                await resp.write(_sse({**head, "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        return resp
    finally:
        engine.release(rid)


# ---- native endpoints --------------------------------------------------------------------------


async def generate(request: web.Request) -> web.StreamResponse:
    """``POST /generate``: SGLang's native API (``text`` or ``input_ids``, ``sampling_params``, ``stream``, ``rid``)."""
    engine = request.app[ENGINE]
    body = await _body(request, openai=False)
    text_in, ids_in = body.get("text"), body.get("input_ids")
    if isinstance(text_in, str) and ids_in is None:
        ids = engine.tokenizer.encode(text_in)
    elif (text_in is None and isinstance(ids_in, list) and ids_in
          and all(isinstance(t, int) and not isinstance(t, bool) for t in ids_in)):
        ids = list(ids_in)
    elif text_in is None and ids_in is None:
        return _json({"error": {"message": "Either text, input_ids or input_embeds should be provided."}}, 400)
    else:
        return _json({"error": {"message": "text must be a string or input_ids a list of token ids "
                                           "(batches are not simulated)"}}, 400)
    params = _field(body, "sampling_params", (dict,), {})
    try:
        max_new = _field(params, "max_new_tokens", (int,), GENERATE_DEFAULT_MAX_NEW_TOKENS)
        stop = _stop_list(params)
        ignore_eos = bool(_field(params, "ignore_eos", (bool,), False))
        stream = bool(_field(body, "stream", (bool,), False))
        rid = _rid(body)
    except ApiError as err:
        return _json({"error": {"message": err.message}}, 400)
    try:
        track = engine.submit(rid, ids, max_new, ignore_eos, stop)
    except ValueError as err:
        return _json({"error": {"message": str(err)}}, 400)
    reply = _ReplyText(engine.tokenizer, stop)

    def out(ev: RequestEvent, text: str) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid, "finish_reason": _finish_reason_dict(ev), "prompt_tokens": ev.prompt_tokens,
            "weight_version": "default", "reasoning_tokens": 0, "completion_tokens": ev.completion_tokens,
            "cached_tokens": ev.cached_tokens,
        }
        if ev.finished:
            meta["e2e_latency"] = engine.clock() - track.arrival
        return {"text": text, "output_ids": list(reply.output_ids), "meta_info": meta}

    try:
        if not stream:
            last = None
            async for last in _events(track):
                text = reply.add(last)
            assert last is not None
            return _json(out(last, text))
        resp = await _open_sse(request)
        async for ev in _events(track):
            await resp.write(_sse(out(ev, reply.add(ev))))
        await resp.write(b"data: [DONE]\n\n")
        return resp
    finally:
        engine.release(rid)


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the one served model."""
    engine = request.app[ENGINE]
    name = engine.sim.served_model_name
    return _json({"object": "list", "data": [{
        "id": name, "object": "model", "created": int(engine.startup_time), "owned_by": "sglang", "root": name,
        "parent": None, "max_model_len": engine.sim.config.context_length}]})


async def model_info(request: web.Request) -> web.Response:
    """``GET /model_info``: model identity (SGLang's fields)."""
    sim = request.app[ENGINE].sim
    return _json({
        "model_path": sim.args.model_path, "served_model_name": sim.served_model_name,
        "tokenizer_path": sim.tokenizer_path, "is_generation": True, "preferred_sampling_params": None,
        "weight_version": "default", "load_format": "sim", "reasoning_parser": None, "tool_call_parser": None,
        "disaggregation_mode": "null", "has_image_understanding": False, "has_audio_understanding": False,
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
    })


async def server_info(request: web.Request) -> web.Response:
    """``GET /server_info``: the resolved arguments plus live state."""
    engine = request.app[ENGINE]
    sim = engine.sim
    stats = engine.core.stats()
    info = dataclasses.asdict(sim.args)
    info.update(
        served_model_name=sim.served_model_name, tokenizer_path=sim.tokenizer_path, sim_model=sim.sim_model,
        mem_fraction_static=sim.mem_fraction_static, cuda_graph_max_bs_decode=sim.cuda_graph_max_bs_decode,
        chunked_prefill_size=sim.config.chunked_prefill_size or -1, max_total_tokens=sim.config.max_total_tokens,
        max_running_requests=sim.config.max_running_requests, context_length=sim.config.context_length,
        max_total_num_tokens=sim.config.max_total_tokens, mfu=sim.latency.mfu, mbu=sim.latency.mbu,
        startup_time=engine.startup_time, version=SGLANG_VERSION, frontend="python",
        internal_states=[{"last_gen_throughput": stats.gen_throughput, "token_usage": stats.token_usage,
                          "num_running_reqs": stats.num_running_reqs, "num_queue_reqs": stats.num_waiting_reqs}],
    )
    return _json(info)


LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def _load_dict(engine: SimEngine, include: set[str] | None) -> dict[str, Any]:
    s = engine.core.stats()
    sim = engine.sim
    load: dict[str, Any] = {
        "timestamp": time.time(), "dp_rank": 0,
        "num_running_reqs": s.num_running_reqs, "num_waiting_reqs": s.num_waiting_reqs,
        "num_waiting_uncached_tokens": s.num_waiting_uncached_tokens, "num_used_tokens": s.num_used_tokens,
        "num_total_tokens": s.num_total_tokens, "num_active_tokens": s.num_total_tokens,
        "num_prealloc_ready_tokens": 0, "max_total_num_tokens": s.max_total_num_tokens,
        "max_running_requests": s.max_running_requests, "token_usage": round(s.token_usage, 4),
        "gen_throughput": round(s.gen_throughput, 2), "cache_hit_rate": round(s.cache_hit_rate, 4),
        "utilization": round(s.utilization, 4), "total_prefill_uncached_tokens": s.total_prefill_uncached_tokens,
        "total_prefill_busy_us": int(s.total_prefill_busy_s * 1e6), "decode_moments": None,
    }
    if include == {"core"}:
        return load
    every = include is None or "all" in include
    m = sim.latency.model
    sections = {
        "memory": ("memory", {
            "weight_gb": round(m.params * m.dtype_bytes / sim.latency.tp_size / 1e9, 3),
            "kv_cache_gb": round(s.max_total_num_tokens * m.kv_bytes_per_token / sim.latency.tp_size / 1e9, 3),
            "graph_gb": 0.0, "token_capacity": s.max_total_num_tokens}),
        "disaggregation": ("disagg", {
            "mode": "null", "prefill_bootstrap_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
            "decode_prealloc_queue_reqs": 0, "decode_transfer_queue_reqs": 0, "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0}),
        "queues": ("queues", {"waiting": s.num_waiting_reqs, "grammar": 0, "paused": 0, "retracted": 0,
                              "prealloc_ready": 0}),
    }
    for key, (name, section) in sections.items():
        if every or (include is not None and name in include):
            load[key] = section
    return load


async def loads(request: web.Request) -> web.Response:
    """``GET /v1/loads``: SGLang's per-rank load snapshot (``include``, ``format=prometheus``, ``dp_rank``)."""
    engine = request.app[ENGINE]
    include_q = request.query.get("include")
    include = {p.strip() for p in include_q.split(",")} if include_q else None
    if include is not None and not include <= LOAD_SECTIONS:
        raise ApiError(f"Invalid include sections: {include - LOAD_SECTIONS}. "
                       f"Valid options: {sorted(LOAD_SECTIONS)}", "400")
    dp_rank = request.query.get("dp_rank")
    results = [] if dp_rank not in (None, "0") else [_load_dict(engine, include)]
    if request.query.get("format") == "prometheus":
        lines = []
        prefixes = {"disaggregation": "disagg"}
        for load in results:
            rank = load.pop("dp_rank")
            for key, value in load.items():
                items = ([(f"sglang_{prefixes.get(key, key)}_{k}", v) for k, v in value.items()]
                         if isinstance(value, dict) else [(f"sglang_{key}", value)])
                for name, v in items:
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        lines += [f"# TYPE {name} gauge", f'{name}{{dp_rank="{rank}"}} {v}']
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
    return _json({
        "timestamp": datetime.now(timezone.utc).isoformat(), "version": SGLANG_VERSION,
        "accelerator": f"NVIDIA {engine.sim.latency.gpu.name.upper()} (simulated)",
        "num_accelerators": engine.sim.latency.tp_size, "loads": results,
    })


async def ready(request: web.Request) -> web.Response:
    """``GET /ready``: 200 once serving, else 503."""
    return web.Response(status=200 if request.app[ENGINE].ready else 503)


async def health(request: web.Request) -> web.Response:
    """``GET /health``: run a 1-token generation through the core; 200 when it comes back, 503 otherwise."""
    engine = request.app[ENGINE]
    if not engine.ready:
        return web.Response(status=503)
    rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
    track = engine.submit(rid, [0], 1, False, [])
    try:
        async with asyncio.timeout(HEALTH_CHECK_TIMEOUT_S):
            async for _ in _events(track):
                pass
    except TimeoutError:
        log.error("health check failed: no token within %.0f s", HEALTH_CHECK_TIMEOUT_S)
        return web.Response(status=503)
    finally:
        engine.release(rid)
    return web.Response(status=200)


async def abort_request(request: web.Request) -> web.Response:
    """``POST /abort_request``: ``{"rid": ...}`` or ``{"abort_all": true}``; 200 either way."""
    engine = request.app[ENGINE]
    body = await _body(request, openai=False)
    if body.get("abort_all"):
        engine.abort_all()
    elif isinstance(body.get("rid"), str) and body["rid"]:
        engine.abort(body["rid"])
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    """``POST|GET /flush_cache``: empty the prefix cache when idle (400 while requests run)."""
    if request.app[ENGINE].core.flush_cache():
        return web.Response(text=FLUSH_OK)
    return web.Response(text="Flush cache failed: there are running or waiting requests.\n", status=400)


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text from the engine's own registry."""
    engine = request.app[ENGINE]
    engine.update_gauges()
    return web.Response(body=generate_latest(engine.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


# ---- app ---------------------------------------------------------------------------------------


def create_app(args: SimServerArgs, tokenizer: ChatTokenizer | None = None) -> web.Application:
    """The aiohttp application of one simulated engine; ``tokenizer`` overrides the resolved one.

    Serve it with ``handler_cancellation=True`` so a client disconnect aborts its request.

    Raises:
        ValueError: as :func:`resolve_args`.
    """
    sim = resolve_args(args)
    tok = tokenizer or load_tokenizer(Path(sim.tokenizer_path) if sim.tokenizer_path else None)
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
    engine = SimEngine(sim, tok)
    app[ENGINE] = engine

    async def engine_ctx(_: web.Application) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.stop()

    app.cleanup_ctx.append(engine_ctx)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_route("POST", "/generate", generate)
    app.router.add_route("PUT", "/generate", generate)
    app.router.add_get("/v1/models", models)
    for path, handler in (("/model_info", model_info), ("/get_model_info", model_info),
                          ("/server_info", server_info), ("/get_server_info", server_info),
                          ("/v1/loads", loads), ("/ready", ready), ("/health", health),
                          ("/health_generate", health), ("/flush_cache", flush_cache)):
        app.router.add_get(path, handler)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/abort_request", abort_request)
    if args.enable_metrics:
        app.router.add_get("/metrics", metrics)
    return app


def run(args: SimServerArgs) -> None:
    """Serve until SIGINT/SIGTERM (uvloop when installed); returns normally on shutdown."""
    try:
        import uvloop
    except ImportError:
        loop = asyncio.new_event_loop()
    else:
        loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    app = create_app(args)
    sim = app[ENGINE].sim
    log.info("simulated SGLang engine: %s on %s x%d, max_total_tokens=%d, max_running_requests=%d, "
             "chunked_prefill_size=%s, serving %s at http://%s:%d", sim.sim_model, sim.latency.gpu.name,
             sim.latency.tp_size, sim.config.max_total_tokens, sim.config.max_running_requests,
             sim.config.chunked_prefill_size, sim.served_model_name, args.host, args.port)
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, print=None, access_log=None,
                loop=loop)
