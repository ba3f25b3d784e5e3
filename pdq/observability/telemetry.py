"""OpenTelemetry tracing of pdq: one trace per request, across every process.

Each process is its own service (`pdq-gateway`, `pdq-scheduler`, `pdq-prefill`, `pdq-decode`;
`OTEL_SERVICE_NAME` overrides) and calls `setup(role)` once at start. Tracing is on when an
exporter is configured by the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_TRACES_EXPORTER=otlp|console`); the SDK reads
the rest itself (`OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_HEADERS`, ...).
Otherwise `enabled()` is False: no provider is installed, no interceptor traces, and every
helper here returns at once (`None` spans), so the hot loops do no tracing work at all.

Context travels as W3C `traceparent`: in gRPC metadata between processes (`pdq.observability.telemetry_grpc`),
and in `RequestSpec.traceparent`, which the gateway sets to its server span before
Submit and which is stored with the request in Redis, so every later hop (queue wait, prefill,
KV transfer, decode, cancel, requeue) continues the request's trace, on any worker, at any
attempt. Attributes follow the GenAI conventions where they fit (`gen_ai.*`); the rest are
`pdq.*`. Prompt and output text go into spans only with `PDQ_TRACE_CONTENT=1`.
"""

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("pdq.telemetry")

SERVICE_NAMES = {"gateway": "pdq-gateway", "scheduler": "pdq-scheduler",
                 "prefill worker": "pdq-prefill", "decode worker": "pdq-decode"}

_enabled = False
_provider: Any = None
_propagator = TraceContextTextMapPropagator()
_tracer: trace.Tracer = trace.NoOpTracer()


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


TRACE_CONTENT = _truthy("PDQ_TRACE_CONTENT")


def wanted() -> bool:
    """True when the environment configures a trace exporter (and the SDK is not disabled)."""
    if _truthy("OTEL_SDK_DISABLED"):
        return False
    exporters = [e.strip().lower() for e in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    if "none" in exporters:
        return False
    if exporters:
        return True
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def enabled() -> bool:
    return _enabled


def setup(role: str, instance: str = "") -> bool:
    """Installs the tracer provider of this process when `wanted()`. -> whether tracing is on."""
    global _enabled, _provider, _tracer
    if _enabled or not wanted():
        return _enabled
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.name": os.environ.get("OTEL_SERVICE_NAME") or SERVICE_NAMES.get(role, f"pdq-{role}"),
                  "service.namespace": "pdq"}
    if instance:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attributes))  # sampler from OTEL_TRACES_SAMPLER
    for exporter in _exporters():
        provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_* delays and sizes
    trace.set_tracer_provider(provider)
    _provider = provider
    _tracer = provider.get_tracer("pdq")
    _enabled = True
    log.info("tracing on: service %s", attributes["service.name"])
    return True


def _exporters() -> list:
    names = [e.strip().lower() for e in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if e.strip()]
    out = []
    for name in names:
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter
            out.append(ConsoleSpanExporter())
        elif name == "otlp":
            protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
            if protocol.startswith("http"):
                try:
                    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
                except ImportError:
                    log.warning("OTLP protocol %s needs opentelemetry-exporter-otlp-proto-http; using grpc", protocol)
                    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            out.append(OTLPSpanExporter())  # endpoint, headers, TLS, compression from OTEL_EXPORTER_OTLP_*
        else:
            log.warning("unknown OTEL_TRACES_EXPORTER %r ignored", name)
    return out


def tracer() -> trace.Tracer:
    """pdq's tracer (a no-op one when tracing is off)."""
    return _tracer


def shutdown() -> None:
    """Exports what is buffered and stops the exporter (at process exit)."""
    global _enabled
    if _provider is not None:
        _provider.shutdown()
    _enabled = False


# -- W3C context -------------------------------------------------------------------------------

def traceparent(span: Span | None = None) -> str:
    """The `traceparent` of `span` (default: the current span); '' when there is none."""
    span = span if span is not None else trace.get_current_span()
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def context_of(value: str | Mapping[str, str] | None) -> otel_context.Context | None:
    """The context carried by a traceparent string or a metadata mapping; None when absent."""
    if not value:
        return None
    carrier = {"traceparent": value} if isinstance(value, str) else value
    ctx = _propagator.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def span_context_of(traceparent_value: str) -> trace.SpanContext | None:
    ctx = context_of(traceparent_value)
    return trace.get_current_span(ctx).get_span_context() if ctx is not None else None


# -- spans -------------------------------------------------------------------------------------

def start(name: str, parent: str | Span | None = None, *, kind: SpanKind = SpanKind.INTERNAL,
          start_ms: int | None = None, links: Iterable[trace.SpanContext | None] = (),
          attributes: Mapping[str, Any] | None = None) -> Span | None:
    """Starts a span (not made current); None when tracing is off.

    parent: a traceparent string (a request's, from its RequestSpec), a span, or None for the
    current span. start_ms: a start time in the past (Unix ms), e.g. the request's arrival.
    """
    if not _enabled:
        return None
    if isinstance(parent, str):
        ctx = context_of(parent)
    elif parent is not None:
        ctx = trace.set_span_in_context(parent)
    else:
        ctx = None
    return _tracer.start_span(name, context=ctx, kind=kind,
                              start_time=start_ms * 1_000_000 if start_ms else None,
                              links=[Link(c) for c in links if c is not None and c.is_valid],
                              attributes=attributes)


def end(span: Span | None, event: str | None = None, error: str | None = None,
        attributes: Mapping[str, Any] | None = None, event_attributes: Mapping[str, Any] | None = None) -> None:
    """Ends a span, adding an event first and an ERROR status when `error` is given."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if event:
        span.add_event(event, event_attributes or ({"pdq.error": error} if error else None))
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def use(span: Span | None):
    """Makes `span` current in a `with` block (outgoing calls carry its context); no-op for None."""
    if span is None:
        return contextlib.nullcontext()
    return trace.use_span(span, end_on_exit=False)


def current() -> Span | None:
    """The current recording span, or None (tracing off, or no span)."""
    if not _enabled:
        return None
    span = trace.get_current_span()
    return span if span.is_recording() else None


def event(name: str, attributes: Mapping[str, Any] | None = None, error: str | None = None) -> None:
    """Adds an event to the current span; ERROR status when `error` is given."""
    add_event(current(), name, attributes, error)


def add_event(span: Span | None, name: str, attributes: Mapping[str, Any] | None = None,
              error: str | None = None) -> None:
    """Adds an event to `span` (no-op for None); ERROR status when `error` is given."""
    if span is None:
        return
    span.add_event(name, attributes)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))


def request_attributes(spec: Any) -> dict[str, Any]:
    """GenAI and pdq attributes of a `RequestSpec` (no prompt text)."""
    s = spec.sampling
    attrs: dict[str, Any] = {
        "pdq.request_id": spec.request_id, "pdq.tenant": spec.tenant, "pdq.tier": spec.tier,
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.max_tokens": s.max_tokens, "gen_ai.request.temperature": s.temperature,
        "gen_ai.usage.input_tokens": len(spec.prompt_token_ids),
    }
    if s.top_p:
        attrs["gen_ai.request.top_p"] = s.top_p
    if s.top_k:
        attrs["gen_ai.request.top_k"] = s.top_k
    if s.HasField("seed"):
        attrs["gen_ai.request.seed"] = s.seed
    if s.stop:
        attrs["gen_ai.request.stop_sequences"] = list(s.stop)
    if spec.deadline_ms:
        attrs["pdq.deadline_ms"] = spec.deadline_ms
    return attrs


def content_attributes(prompt: str = "", output: str | None = None) -> dict[str, str]:
    """Prompt/output text as GenAI message attributes, only with PDQ_TRACE_CONTENT=1."""
    if not TRACE_CONTENT:
        return {}
    attrs = {}
    if prompt:
        attrs["gen_ai.input.messages"] = json.dumps([{"role": "user", "parts": [{"type": "text", "content": prompt}]}])
    if output is not None:
        attrs["gen_ai.output.messages"] = json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": output}]}])
    return attrs
