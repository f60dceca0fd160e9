"""OpenTelemetry tracing of requests (``--tracing``, off by default). The service imports this module only when
tracing is on, so the base install needs no OpenTelemetry and the serving path pays nothing for it when off.

The spans:

- ``process <request topic>`` (CONSUMER), one per request, from the poll thread's receipt of its record until
  the broker acknowledged every record that answers it (exactly-once: until its transaction committed). It is the
  child of the caller's span when the record carries W3C trace context headers (``traceparent``, ``tracestate``),
  else a root; its reply carries its own context in the same headers, so the caller's trace goes on. Its events
  mark where its time went: ``dispatched`` (the queue wait ended in a batch), then ``preprocess``, ``inference``
  and ``postprocess`` as each stage finished with its micro-batch; from the last one to the span's end it was being
  published. A failed request's span has status ERROR and its error code in ``error.type``.
- ``kinference batch`` (INTERNAL), one per micro-batch, from its dispatch until postprocess finished with it. Its
  requests belong to many traces, so it is the root of a trace of its own, and each request span links to it (the
  other way round is left out: a link per request on the batch span cost as much again and told nothing new).
- ``preprocess``, ``inference``, ``postprocess``: children of the batch span, one per handler call. A handler's own
  spans (or an instrumented library's) nest under them.

Events on the request span, not child spans: a request's phases follow one another, so each is told by its end
alone, and its stage calls are made once per micro-batch. Child spans per phase and request would multiply the
spans to build and export by the batch size and say nothing more.

Every hook runs in the thread that owns the request at that moment (poll, dispatcher, stage, publisher); the hand-
overs between them go through queues, so no span is written by two threads at once.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol, TypeVar

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kinference import __version__
from kinference.consumer.ledger.request import Request
from kinference.consumer.types import Headers
from kinference.errors import ConfigError, RequestError
from kinference.protocol import MAX_ERROR_MESSAGE

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
BATCH_SPAN = "kinference batch"
_PROPAGATOR = TraceContextTextMapPropagator()
_EXPORTER_GROUP = "opentelemetry_traces_exporter"
_OTLP_EXPORTERS = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}
"""The entry point of the OTLP span exporter for each ``OTEL_EXPORTER_OTLP_PROTOCOL``."""


@dataclass(frozen=True, slots=True)
class RequestTrace:
    """The span of one request, from receipt to answer."""

    span: Span

    def context_headers(self) -> Headers:
        """W3C trace context headers naming this span: a reply's ``traceparent`` (and ``tracestate``)."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, set_span_in_context(self.span))
        return [(name, value.encode()) for name, value in carrier.items()]


_UNTRACED = RequestTrace(INVALID_SPAN)
"""A request whose span could not be started: a no-op span, so it is served all the same."""


def _span(request: Request) -> Span:
    """The request's span: the decoder set one from ``Tracing.received`` on every request (a no-op span when it could
    not be started)."""
    trace = request.trace
    return trace.span if isinstance(trace, RequestTrace) else INVALID_SPAN


@dataclass(frozen=True, slots=True)
class BatchTrace:
    """The span of one micro-batch, and the context that makes its stage spans children of it."""

    span: Span
    context: Context


class TracedBatch(Protocol):
    """A micro-batch (``pools.MicroBatch``), as its stage spans read it: here, not imported, since the stages
    import this module."""

    active: list[Request]
    """The requests a stage's call is made for."""
    trace: BatchTrace | None


BatchT = TypeVar("BatchT", bound=TracedBatch)


def extract(headers: Headers) -> Context:
    """The caller's span context from a record's W3C trace context headers (the last of each name, as Kafka
    clients read it); an empty context, so a root span, when there is none or it is malformed."""
    carrier = {name: raw.decode("latin-1") for name, raw in headers
               if raw is not None and name in (TRACEPARENT, TRACESTATE)}
    return _PROPAGATOR.extract(carrier)


def request_attributes(request: Request, group_id: str) -> dict[str, Any]:
    """OpenTelemetry's messaging attributes of a consumed Kafka record (semantic conventions 1.27 and later)."""
    attributes: dict[str, Any] = {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": request.topic,
        "messaging.destination.partition.id": str(request.partition),
        "messaging.kafka.offset": request.offset,
        "messaging.consumer.group.name": group_id,
        "messaging.message.conversation_id": request.correlation_id,
    }
    if request.key is not None:
        attributes["messaging.kafka.message.key"] = request.key.decode("utf-8", "backslashreplace")
    if request.value is not None:
        attributes["messaging.message.body.size"] = len(request.value)
    return attributes


def exporter_names(environ: Mapping[str, str]) -> list[str]:
    """The span exporters ``OTEL_TRACES_EXPORTER`` names (default ``otlp``, ``none`` for none), as entry points of
    OpenTelemetry's ``opentelemetry_traces_exporter`` group. ``otlp`` is the exporter of the OTLP protocol that
    ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` or ``OTEL_EXPORTER_OTLP_PROTOCOL`` name (default ``http/protobuf``, the
    one kinference[otel] installs)."""
    names = [name.strip() for name in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if name.strip()]
    if "none" in names:
        return []
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip()
    if "otlp" in names and protocol not in _OTLP_EXPORTERS:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r} is not one of {', '.join(_OTLP_EXPORTERS)}")
    return [_OTLP_EXPORTERS[protocol] if name == "otlp" else name for name in names]


def _exporter(name: str) -> SpanExporter:
    found = entry_points(group=_EXPORTER_GROUP, name=name)
    if not found:
        raise ConfigError(f"OTEL_TRACES_EXPORTER: no span exporter {name!r} is installed (kinference[otel] brings "
                          "otlp over http/protobuf and console; otlp over grpc needs pip install "
                          "opentelemetry-exporter-otlp-proto-grpc)")
    exporter: SpanExporter = next(iter(found)).load()()
    return exporter


def _resource() -> Resource:
    """OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, with kinference as the service's name unless they name it."""
    resource = Resource.create({SERVICE_VERSION: __version__})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "kinference"}))
    return resource


def _wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` instant as epoch nanoseconds, which spans take: the service times with the first."""
    return time.time_ns() - time.monotonic_ns() + int(monotonic_s * 1e9)


class Tracing:
    """Records the spans of requests and micro-batches through ``provider``.

    ``open`` makes the provider from the OpenTelemetry environment variables (exporters, ``OTEL_TRACES_SAMPLER``,
    the resource, ``OTEL_BSP_*``) unless one is given (tests give one with an in-memory exporter); ``close``
    flushes it, and shuts down the one it made.
    """

    def __init__(self, provider: TracerProvider, group_id: str, *, owned: bool = False) -> None:
        self._provider = provider
        self._owned = owned
        self._tracer = provider.get_tracer("kinference", __version__)
        self._group_id = group_id

    @classmethod
    def open(cls, group_id: str, provider: TracerProvider | None = None) -> Tracing:
        if provider is not None:
            return cls(provider, group_id)
        exporters = [_exporter(name) for name in exporter_names(os.environ)]  # before any processor thread starts
        # The service's stop flushes and shuts the provider down: no exit hook of its own.
        provider = TracerProvider(resource=_resource(), shutdown_on_exit=False)
        for exporter in exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        log.info("tracing on: exporters %s", ", ".join(type(exporter).__name__ for exporter in exporters) or "none")
        return cls(provider, group_id, owned=True)

    def close(self, timeout_s: float) -> None:
        """Export what is recorded, within ``timeout_s`` for a provider given to ``open``."""
        self._provider.force_flush(int(timeout_s * 1000))
        if self._owned:
            self._provider.shutdown()

    # --- the request's way through the service

    def received(self, request: Request) -> RequestTrace:
        """The span of a request just decoded, started (poll thread): the decoder sets it on the request."""
        try:
            return RequestTrace(self._tracer.start_span(
                f"process {request.topic}", extract(request.headers), SpanKind.CONSUMER,
                attributes=request_attributes(request, self._group_id), start_time=_wall_ns(request.received)))
        except Exception:  # the request is tracked already: a tracing fault must not keep it from its answer
            log.exception("could not start the span of a request; it is served untraced")
            return _UNTRACED

    def batch(self, requests: list[Request]) -> BatchTrace:
        """Start the span of a micro-batch just dispatched, and end its requests' queue wait (dispatcher thread)."""
        size = len(requests)
        started = time.time_ns()  # the batcher dispatched them a moment ago, in this thread
        span = self._tracer.start_span(
            BATCH_SPAN, Context(), SpanKind.INTERNAL, start_time=started,
            attributes={"messaging.system": "kafka", "messaging.consumer.group.name": self._group_id,
                        "messaging.batch.message_count": size})
        batch_context = span.get_span_context()
        for request in requests:
            request_span = _span(request)
            request_span.add_link(batch_context)
            request_span.add_event("dispatched", timestamp=started)
        return BatchTrace(span, set_span_in_context(span))

    def stage(self, name: str, work: Callable[[BatchT], None]) -> Callable[[BatchT], None]:
        """``work`` (a stage's call on one micro-batch) in a child span of the micro-batch's span, and an event on
        the span of each request it was called for."""
        tracer = self._tracer

        def traced(micro_batch: BatchT) -> None:
            active = micro_batch.active  # a failing call replaces the list: these are the requests it was made for
            try:
                # Current in this thread while the handler runs, so that the handler's own spans nest under it; an
                # exception sets its status ERROR and goes on to the stage, which fails the micro-batch.
                with tracer.start_as_current_span(name, micro_batch.trace.context if micro_batch.trace else None,
                                                  attributes={"messaging.batch.message_count": len(active)}):
                    work(micro_batch)
            finally:
                ended = time.time_ns()
                for request in active:
                    _span(request).add_event(name, timestamp=ended)

        return traced

    def answered(self, requests: list[Request], errors: Mapping[Request, RequestError] | None = None) -> None:
        """End the span of each request whose answer the broker has (publisher thread); ``errors``: those the
        delivery answered with an error of its own (``delivery.answers.Settled.errors``)."""
        ended = time.time_ns()
        for request in requests:
            span = _span(request)
            error = request.error or (errors.get(request) if errors else None)
            if error is not None:
                span.set_attribute("error.type", str(error.code))
                span.set_status(Status(StatusCode.ERROR, error.message[:MAX_ERROR_MESSAGE]))
            span.end(ended)
