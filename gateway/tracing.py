"""OpenTelemetry tracing of the gateway's requests (``tracing:`` in the config; off by default).

One SERVER span per ``POST /v1/chat/completions`` or ``/v1/completions``
(``POST <path>``; it joins the client's trace when the request carries a W3C
``traceparent``, and lasts until the last byte of a stream is written), with
child spans in request order:

* ``validation``: reading the JSON body, the schema and the model name;
* ``tokenization``: the templated prompt's tokens and prefix block keys
  (``laps.prompt_tokens``);
* ``queueing``: from submission to the scheduler until the dispatch decision
  (``laps.class``, ``laps.prompt_tokens``, ``laps.new_tokens``,
  ``laps.queued_ahead``: requests already waiting, ``laps.engine``: where it
  went); its duration is the request's batching window;
* ``engine call`` (CLIENT, from :class:`engines.client.EngineClient`): the
  request to the engine until its answer is read, with
  ``http.response.status_code``; the engine gets a W3C ``traceparent`` whose
  parent is this span, so an SGLang engine started with tracing joins the trace.

Spans go through a batch processor to an OTLP/HTTP exporter at
``tracing.endpoint`` (or the exporter a test passes); the provider belongs to
one app (no global tracer provider), so several gateways can run in one process.
"""

from __future__ import annotations

import contextlib
from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from laps.config import TracingConfig

TRACED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


def tracer_provider(config: TracingConfig, exporter: SpanExporter | None = None) -> TracerProvider:
    """A provider for ``config`` exporting through ``exporter`` (default: OTLP over HTTP to ``config.endpoint``)."""
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=config.endpoint)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: config.service_name}),
                              sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def tracing_middleware(tracer: Tracer):
    """An aiohttp middleware that runs each generation request (:data:`TRACED_PATHS`) in a SERVER span."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in TRACED_PATHS:
            return await handler(request)
        name = f"{request.method} {request.path}"
        with tracer.start_as_current_span(name, context=propagate.extract(request.headers), kind=SpanKind.SERVER,
                                          attributes={"http.request.method": request.method, "url.path": request.path},
                                          record_exception=True) as span:
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            return response

    return middleware


_OFF = contextlib.nullcontext()  # reentrant and reusable: yields None


def child_span(tracer: Tracer | None, name: str) -> contextlib.AbstractContextManager[trace.Span | None]:
    """A child span of the current one named ``name``, as ``with``; nothing (``None`` yielded) when tracing is off."""
    return _OFF if tracer is None else tracer.start_as_current_span(name)
