"""OpenTelemetry tracing: the span tree of a streamed request (SDK in-memory exporter), traceparent to the engine."""

from __future__ import annotations

import logging

import aiohttp
from aiohttp.test_utils import TestServer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.app import create_app
from laps.config import load_config, parse_config
from tests.fake_engine import FakeEngine

MODEL = "Qwen2.5-7B-Instruct"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


async def run_gateway(tracing: dict, requests: list[tuple[dict, dict]]) -> tuple[InMemorySpanExporter, FakeEngine]:
    """Send ``requests`` ((body, headers) pairs) through a gateway over fake engines, close it, return the spans."""
    exporter = InMemorySpanExporter()
    fakes = {"sp0": FakeEngine("sp0"), "lp0": FakeEngine("lp0")}
    servers = {name: TestServer(f.app) for name, f in fakes.items()}
    for s in servers.values():
        await s.start_server()
    config = parse_config({**load_config().model_dump(exclude_unset=True), "tracing": tracing})
    gateway = TestServer(create_app(config, {n: str(s.make_url("")).rstrip("/") for n, s in servers.items()}, exporter))
    await gateway.start_server()
    async with aiohttp.ClientSession(str(gateway.make_url(""))) as session:
        for body, headers in requests:
            async with session.post("/v1/chat/completions", json=body, headers=headers) as resp:
                await resp.read()
    await gateway.close()  # flushes the batched spans
    for s in servers.values():
        await s.close()
    return exporter, fakes["sp0"]


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **extra}


async def test_a_streamed_request_is_one_span_with_its_steps_as_children_and_the_engine_joins_the_trace():
    exporter, engine = await run_gateway({"enabled": True}, [(chat(stream=True), {})])
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans.pop("POST /v1/chat/completions")
    assert sorted(spans) == ["engine call", "queueing", "tokenization", "validation"]
    assert root.kind == SpanKind.SERVER and root.parent is None and root.attributes["http.response.status_code"] == 200
    assert all(s.parent.span_id == root.context.span_id and s.context.trace_id == root.context.trace_id for s in spans.values())
    # In request order, and the root lasts until the stream has ended (the engine call is inside it).
    order = [spans[n] for n in ("validation", "tokenization", "queueing", "engine call")]
    assert all(a.end_time <= b.start_time for a, b in zip(order, order[1:]))
    assert root.start_time <= order[0].start_time and order[-1].end_time <= root.end_time
    queueing, call = spans["queueing"], spans["engine call"]
    assert {k: queueing.attributes[k] for k in ("laps.class", "laps.engine", "laps.queued_ahead")} == {
        "laps.class": "short", "laps.engine": "sp0", "laps.queued_ahead": 0}
    assert spans["tokenization"].attributes["laps.prompt_tokens"] == queueing.attributes["laps.prompt_tokens"] > 0
    assert call.kind == SpanKind.CLIENT and call.attributes["http.response.status_code"] == 200
    (headers,) = engine.headers
    assert headers["traceparent"] == f"00-{call.context.trace_id:032x}-{call.context.span_id:016x}-{call.context.trace_flags:02x}"
    assert call.context.trace_flags.sampled


async def test_a_client_traceparent_is_joined_and_bad_requests_are_traced_too():
    client = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    exporter, _ = await run_gateway({"enabled": True}, [(chat(), client), (chat(max_tokens="ten"), {})])
    roots = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/chat/completions"]
    assert f"{roots[0].context.trace_id:032x}" == CLIENT_TRACE and f"{roots[0].parent.span_id:016x}" == CLIENT_SPAN
    assert roots[1].attributes["http.response.status_code"] == 400
    (validation,) = [s for s in exporter.get_finished_spans() if s.name == "validation" and s.parent.span_id == roots[1].context.span_id]
    assert not validation.status.is_ok


async def test_tracing_is_off_by_default_and_sends_no_traceparent(caplog):
    caplog.set_level(logging.INFO, "laps.gateway")
    exporter, engine = await run_gateway({}, [(chat(stream=True), {})])
    assert exporter.get_finished_spans() == () and "traceparent" not in engine.headers[0]
    assert "tracing off (tracing.enabled: false)" in [r.getMessage() for r in caplog.records]


async def test_startup_logs_that_tracing_is_on_and_where_spans_go(caplog):
    caplog.set_level(logging.INFO, "laps.gateway")
    await run_gateway({"enabled": True, "sample_ratio": 0.5}, [])
    assert "tracing on: spans to InMemorySpanExporter as laps-gateway, sample ratio 0.5" in [r.getMessage() for r in caplog.records]
