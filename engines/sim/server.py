"""HTTP shell of the simulated engine: SGLang 0.5.23's HTTP API over :class:`~engines.sim.core.EngineCore` in real time.

The engine loop lives in :mod:`engines.sim.realtime`, the OpenAI endpoints in
:mod:`engines.sim.openai_api`, shared request/response shapes in
:mod:`engines.sim.protocol`; this module has the native endpoints and the app
(shapes read from SGLang 0.5.23's ``entrypoints/http_server.py`` and ``v1_loads.py``):

* ``POST /v1/chat/completions``, ``POST /v1/completions`` (OpenAI, SSE or JSON);
* ``POST /generate`` (cumulative ``text`` and ``output_ids`` per SSE chunk);
* ``GET /v1/models`` (and ``/v1/models/{model}``), ``/model_info``, ``/server_info``, ``/v1/loads``, ``/ready``,
  ``/health`` (a 1-token generation), ``/metrics`` (with ``--enable-metrics``);
  ``POST /abort_request``, ``/flush_cache``;
* with ``--kv-events-config``, the prefix cache's KV cache events over ZMQ, as SGLang
  publishes them (:mod:`engines.sim.kv_publisher`).
* ``POST /pd_role_switch`` (:mod:`engines.sim.role_switch`).

A client that disconnects aborts its request (counted in
``sglang:num_aborted_requests_total``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engines.sim.args import SimServerArgs, resolve_args
from engines.sim.core import EngineConfig, RequestEvent
from engines.sim.faults import FAULT, hung, parse_fault
from engines.sim.kv_publisher import KVEventPublisher
from engines.sim.kv_transfer import kv_transfer_bytes
from engines.sim.openai_api import chat_completions, completions
from engines.sim.pd_http import PDShell
from engines.sim.protocol import (
    ApiError,
    ReplyText,
    check_sampling,
    errors_middleware,
    field,
    finish_reason_dict,
    json_response,
    open_sse,
    read_body,
    request_id,
    sse,
    stop_list,
)
from engines.sim.realtime import ENGINE, HEALTH_CHECK_RID_PREFIX, SimEngine
from engines.sim.role_switch import add_role_switch_route
from laps.heap import freeze_heap
from laps.tokenizer import ChatTokenizer, load_tokenizer

log = logging.getLogger("engines.sim")

SGLANG_VERSION = "0.5.23"
HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang 0.5.23 HEALTH_CHECK_TIMEOUT
HEALTH_CHECK_POLL_S = 1.0  # its health_generate looks for output once a second
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang SamplingParams default
FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n")


async def generate(request: web.Request) -> web.StreamResponse:
    """``POST /generate``: SGLang's native API (``text`` or ``input_ids``, ``sampling_params``, ``stream``, ``rid``)."""
    engine = request.app[ENGINE]
    body = await read_body(request, openai=False)
    text_in, ids_in = body.get("text"), body.get("input_ids")
    if isinstance(text_in, str) and ids_in is None:
        ids = engine.tokenizer.encode(text_in)
    elif (text_in is None and isinstance(ids_in, list) and ids_in
          and all(isinstance(t, int) and not isinstance(t, bool) for t in ids_in)):
        ids = list(ids_in)
    elif text_in is None and ids_in is None:
        return json_response({"error": {"message": "Either text, input_ids or input_embeds should be provided."}}, 400)
    else:
        return json_response({"error": {"message": "text must be a string or input_ids a list of token ids "
                                           "(batches are not simulated)"}}, 400)
    params = field(body, "sampling_params", (dict,), {})
    try:
        max_new = field(params, "max_new_tokens", (int,), GENERATE_DEFAULT_MAX_NEW_TOKENS)
        check_sampling(params, openai=False, max_new_tokens=max_new)
        stop = stop_list(params)
        ignore_eos = bool(field(params, "ignore_eos", (bool,), False))
        stream = bool(field(body, "stream", (bool,), False))
        priority = field(body, "priority", (int,))
        rid = request_id(body)
    except ApiError as err:
        return json_response({"error": {"message": err.message}}, 400)
    try:
        track = engine.submit(rid, ids, max_new, ignore_eos, stop, priority)
    except ValueError as err:
        return json_response({"error": {"message": str(err)}}, 400)
    reply = ReplyText(engine.tokenizer, stop)

    def out(ev: RequestEvent, text: str) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid, "finish_reason": finish_reason_dict(ev), "prompt_tokens": ev.prompt_tokens,
            "weight_version": "default", "reasoning_tokens": 0, "completion_tokens": ev.completion_tokens,
            "cached_tokens": ev.cached_tokens,
        }
        if ev.finished:
            meta["e2e_latency"] = engine.clock() - track.arrival
        return {"text": text, "output_ids": list(reply.output_ids), "meta_info": meta}

    try:
        if not stream:
            last = None
            async for last in track.events():
                text = reply.add(last)
            assert last is not None
            return json_response(out(last, text))
        resp = await open_sse(request)
        async for ev in track.events():
            await resp.write(sse(out(ev, reply.add(ev))))
        await resp.write(b"data: [DONE]\n\n")
        return resp
    finally:
        engine.release(rid)


def _model_card(engine: SimEngine) -> dict:
    """The served model as SGLang 0.5.23's ``/v1/models`` lists it."""
    name = engine.sim.served_model_name
    return {"id": name, "object": "model", "created": int(engine.startup_time), "owned_by": "sglang", "root": name,
            "parent": None, "max_model_len": engine.sim.config.context_length}


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the one served model."""
    return json_response({"object": "list", "data": [_model_card(request.app[ENGINE])]})


async def retrieve_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: the served model's card, or SGLang 0.5.23's 404 for another name."""
    engine, model = request.app[ENGINE], request.match_info["model"]
    if model != engine.sim.served_model_name:
        return json_response({"error": {"message": f"The model '{model}' does not exist", "type": "invalid_request_error",
                                        "param": "model", "code": "model_not_found"}}, status=404)
    return json_response(_model_card(engine))


async def model_info(request: web.Request) -> web.Response:
    """``GET /model_info``: model identity (SGLang's fields)."""
    sim = request.app[ENGINE].sim
    return json_response({
        "model_path": sim.args.model_path, "served_model_name": sim.served_model_name,
        "tokenizer_path": sim.tokenizer_path, "is_generation": True, "preferred_sampling_params": None,
        "weight_version": "default", "load_format": "sim", "reasoning_parser": None, "tool_call_parser": None,
        "disaggregation_mode": request.app[ENGINE].core.config.disaggregation_mode, "has_image_understanding": False, "has_audio_understanding": False,
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
        mem_fraction_static=sim.mem_fraction_static, disaggregation_mode=engine.core.config.disaggregation_mode,
        cuda_graph_config={phase: {"backend": g.backend, "bs": list(g.sizes)}
                           for phase, g in (("decode", sim.decode_graph), ("prefill", sim.prefill_graph))},
        chunked_prefill_size=sim.config.chunked_prefill_size or -1, max_total_tokens=sim.config.max_total_tokens,
        max_running_requests=sim.config.max_running_requests, context_length=sim.config.context_length,
        max_total_num_tokens=sim.config.max_total_tokens, mfu=sim.latency.mfu, mbu=sim.latency.mbu,
        startup_time=engine.startup_time, version=SGLANG_VERSION, frontend="python",
        internal_states=[{"last_gen_throughput": stats.gen_throughput, "token_usage": stats.token_usage,
                          "num_running_reqs": stats.num_running_reqs, "num_queue_reqs": stats.num_waiting_reqs}],
    )
    return json_response(info)


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
            "mode": engine.core.config.disaggregation_mode, "prefill_bootstrap_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
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
    return json_response({
        "timestamp": datetime.now(timezone.utc).isoformat(), "version": SGLANG_VERSION,
        "accelerator": f"NVIDIA {engine.sim.latency.gpu.name.upper()} (simulated)",
        "num_accelerators": engine.sim.latency.tp_size, "loads": results,
    })


async def ready(request: web.Request) -> web.Response:
    """``GET /ready``: 200 once serving, else 503."""
    return web.Response(status=200 if request.app[ENGINE].ready else 503)


async def health(request: web.Request) -> web.Response:
    """``GET /health``, ``/health_generate``: run a 1-token generation through the core, as SGLang 0.5.23
    (``http_server.health_generate``): 200 once the engine has put out any token since the probe began (checked
    every ``HEALTH_CHECK_POLL_S``: a busy engine answers without waiting for the probe's own turn) or the probe's
    token came, 503 after ``HEALTH_CHECK_TIMEOUT_S`` without either (at once while the engine is not ready). Under
    ``--sim-fault hang`` no token counts: always 503, as on a real engine whose scheduler is stuck."""
    engine = request.app[ENGINE]
    if not engine.ready:
        return web.Response(status=503)
    if engine.pd is not None and engine.pd.mode == "decode":  # takes requests only with KV from a prefill engine
        return web.Response(status=200)
    stuck = hung(request)
    rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
    track = engine.submit(rid, [0], 1, False, [])
    tic = engine.clock()
    token = asyncio.ensure_future(track.queue.get())
    try:
        while (left_s := HEALTH_CHECK_TIMEOUT_S - (engine.clock() - tic)) > 0:
            await asyncio.wait({token}, timeout=min(HEALTH_CHECK_POLL_S, left_s))
            if not stuck and (token.done() or engine.last_output_s > tic):
                return web.Response(status=200)
        log.error("health check failed: no token within %.0f s", HEALTH_CHECK_TIMEOUT_S)
        return web.Response(status=503)
    finally:
        token.cancel()
        engine.release(rid)


async def abort_request(request: web.Request) -> web.Response:
    """``POST /abort_request``: ``{"rid": ...}`` or ``{"abort_all": true}``; 200 either way."""
    engine = request.app[ENGINE]
    body = await read_body(request, openai=False)
    if body.get("abort_all"):
        engine.abort_all()
    elif isinstance(body.get("rid"), str) and body["rid"]:
        engine.abort(body["rid"])
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    """``POST|GET /flush_cache``: empty the prefix cache when idle (400 while requests run)."""
    engine = request.app[ENGINE]
    if engine.core.flush_cache():
        engine.publish_kv_events()
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
    app = web.Application(middlewares=[errors_middleware], client_max_size=64 * 1024 * 1024)
    engine = SimEngine(sim, tok)
    app[ENGINE] = engine
    fault = parse_fault(args.sim_fault)
    if fault is not None:
        app[FAULT] = fault
    if args.disaggregation_mode != "null":
        rank_kv_bytes_per_token = kv_transfer_bytes(sim.latency.model.kv_bytes_per_token, 1, sim.latency.tp_size)
        engine.pd = PDShell(engine, args.disaggregation_mode, args.sim_kv_link_gb_s * 1e9, rank_kv_bytes_per_token)

    async def engine_ctx(_: web.Application) -> AsyncIterator[None]:
        if sim.kv_events is not None:
            engine.kv_publisher = KVEventPublisher(sim.kv_events)
        await engine.start()
        bootstrap = None
        if engine.pd is not None and (engine.pd.mode == "prefill" or args.enable_pd_role_switch):  # SGLang: every flip-capable PD engine
            bootstrap = web.AppRunner(engine.pd.bootstrap_app(), access_log=None)
            await bootstrap.setup()
            await web.TCPSite(bootstrap, args.host, args.disaggregation_bootstrap_port).start()
        yield
        await engine.stop()
        if engine.kv_publisher is not None:
            await engine.kv_publisher.close()
        if engine.pd is not None:
            await engine.pd.close()
        if bootstrap is not None:
            await bootstrap.cleanup()

    app.cleanup_ctx.append(engine_ctx)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_route("POST", "/generate", generate)
    app.router.add_route("PUT", "/generate", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)
    for path, handler in (("/model_info", model_info), ("/get_model_info", model_info),
                          ("/server_info", server_info), ("/get_server_info", server_info),
                          ("/v1/loads", loads), ("/ready", ready), ("/health", health),
                          ("/health_generate", health), ("/flush_cache", flush_cache)):
        app.router.add_get(path, handler)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/abort_request", abort_request)
    add_role_switch_route(app)
    if args.enable_metrics:
        app.router.add_get("/metrics", metrics)
    return app


async def _drain_on_the_first_sigterm(_: web.Application) -> None:
    """``on_startup``: a SIGTERM starts the graceful shutdown (aiohttp's: the requests in flight finish, up to
    ``shutdown_timeout``), and further ones are logged and ignored, as SGLang drains once. aiohttp's own handler
    (``GracefulExit`` on every signal) would turn a second SIGTERM into the abort of every request in flight; and a
    second one comes when the gateway process that started the engine dies: the kernel sends the parent-death signal
    (``PR_SET_PDEATHSIG``, :func:`engines.manager.die_with_parent`) once for each of the engine's threads that
    carries it. SIGINT keeps aiohttp's handler: a second Ctrl-C stops at once."""
    loop = asyncio.get_running_loop()

    def draining() -> None:
        log.info("SIGTERM again: still draining the requests in flight")

    def first() -> None:
        log.info("SIGTERM: draining the requests in flight, then stopping")
        loop.add_signal_handler(signal.SIGTERM, draining)
        raise web.GracefulExit()

    loop.add_signal_handler(signal.SIGTERM, first)


async def _freeze_heap(_: web.Application) -> None:
    """``on_startup``, once the engine is built: its start-up heap (tokenizer, latency model) out of the garbage
    collector's full passes, which would stall the serving loop (:mod:`laps.heap`)."""
    freeze_heap()


def plugin_lines(config: EngineConfig) -> list[str]:
    """What the engine says at start-up of the order of laps' plugin it models (the real plugin's log lines)."""
    if config.late_last_ttft_s is None:
        return []
    lines = [f"shortest-prefill-first puts requests that have waited longer than {config.late_last_ttft_s:g} s + "
             f"{config.late_last_per_1k_s:g} s per 1,000 new tokens behind all others (laps' plugin, modelled)"]
    if config.late_last_deadline_order_tokens is not None:
        lines.append(f"requests in time of more than {config.late_last_deadline_order_tokens} new tokens go by deadline, "
                     f"less the longest ones where, at {config.late_last_prefill_s_per_1k:g} s per 1,000 new tokens after "
                     "the chunked prefill in progress, one would end late (Moore's order)")
    if config.late_last_short_pass_tokens is not None:
        lines.append(f"a prefill pass that carries requests in time of at most {config.late_last_deadline_order_tokens} "
                     f"new tokens holds at most {config.late_last_short_pass_tokens} tokens, or what they need where "
                     "more (short passes)")
    if config.decode_turn_short_tokens is not None:
        lines.append("a decode pass that --prefill-decode-interval owes is kept only while no chunked prefill is in "
                     f"progress and every waiting request has at most {config.decode_turn_short_tokens} new "
                     "tokens (decode turns)")
    return lines


def run(args: SimServerArgs) -> None:
    """Serve until SIGINT/SIGTERM (uvloop when installed); returns normally on shutdown
    (:func:`_drain_on_the_first_sigterm`)."""
    try:
        import uvloop
    except ImportError:
        loop = asyncio.new_event_loop()
    else:
        loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    app = create_app(args)
    app.on_startup.append(_drain_on_the_first_sigterm)
    app.on_startup.append(_freeze_heap)
    sim = app[ENGINE].sim
    log.info("simulated SGLang engine: %s on %s x%d, max_total_tokens=%d, max_running_requests=%d, "
             "chunked_prefill_size=%s, serving %s at http://%s:%d", sim.sim_model, sim.latency.gpu.name,
             sim.latency.tp_size, sim.config.max_total_tokens, sim.config.max_running_requests,
             sim.config.chunked_prefill_size, sim.served_model_name, args.host, args.port)
    for line in plugin_lines(sim.config):
        log.info("%s", line)
    # backlog: uvicorn's default, which SGLang's HTTP server runs with (aiohttp's own is 128: a burst of new
    # connections beyond it waits for SYN retries).
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, print=None, access_log=None,
                loop=loop, backlog=2048)
