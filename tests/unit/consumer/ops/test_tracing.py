"""OpenTelemetry tracing without a broker: trace context in and out of headers, span attributes, and the spans of
requests driven through the real stages."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.trace import SpanKind, StatusCode

from kinference.consumer.config import Batching, ServiceConfig
from kinference.consumer.delivery.answers import reply_headers
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.ops.tracing import (
    BATCH_SPAN,
    TRACEPARENT,
    TRACESTATE,
    RequestTrace,
    Tracing,
    exporter_names,
    extract,
    request_attributes,
)
from kinference.consumer.path.request import RequestDecoder
from kinference.consumer.path.stages import InProcessInference, ModelRun, Pipeline
from kinference.consumer.service import Service
from kinference.errors import ConfigError
from kinference.handlers.echo import EchoHandler
from tests.fakes import FakeBatches, FakeRecord, make_request

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7
CALLER = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01".encode()


def test_the_callers_context_comes_from_the_last_traceparent_and_its_tracestate():
    context = extract([("traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01"), (TRACEPARENT, CALLER),
                       (TRACESTATE, b"vendor=abc"), ("other", None)])
    from opentelemetry.trace import get_current_span

    parent = get_current_span(context).get_span_context()
    assert (parent.trace_id, parent.span_id, parent.is_remote) == (TRACE_ID, PARENT_ID, True)
    assert parent.trace_state.get("vendor") == "abc"


@pytest.mark.parametrize("headers", [[], [(TRACEPARENT, b"not a traceparent")], [(TRACEPARENT, None)],
                                     [(TRACEPARENT, b"\xff\xfe")], [("Traceparent", CALLER)]])
def test_no_or_a_malformed_traceparent_gives_a_root_span(headers):
    from opentelemetry.trace import get_current_span

    assert not get_current_span(extract(headers)).get_span_context().is_valid


def test_a_replys_trace_context_names_the_request_span(spans):
    provider, _ = spans
    span = provider.get_tracer("test").start_span("request", extract([(TRACEPARENT, CALLER),
                                                                      (TRACESTATE, b"vendor=abc")]))
    request = make_request({"x": 1})
    assert not any(name in (TRACEPARENT, TRACESTATE) for name, _ in reply_headers(request, time.monotonic()))
    request.trace = RequestTrace(span)
    headers = dict(reply_headers(request, time.monotonic()))
    context = span.get_span_context()
    assert headers[TRACEPARENT] == f"00-{TRACE_ID:032x}-{context.span_id:016x}-01".encode()
    assert context.span_id != PARENT_ID
    assert headers[TRACESTATE] == b"vendor=abc"


def test_request_attributes_follow_the_messaging_conventions():
    request = RequestDecoder("replies", 1000).decode(
        FakeRecord(b'{"x": 1}', [("kinference-correlation-id", b"abc")], key=b"k\xff", topic="reqs", partition=2,
                   offset=41))
    assert request_attributes(request, "group") == {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "reqs",
        "messaging.destination.partition.id": "2",
        "messaging.kafka.offset": 41,
        "messaging.consumer.group.name": "group",
        "messaging.message.conversation_id": "abc",
        "messaging.kafka.message.key": "k\\xff",
        "messaging.message.body.size": 8,
    }
    keyless = RequestDecoder("replies", 1000).decode(FakeRecord(None, key=None))
    assert "messaging.kafka.message.key" not in request_attributes(keyless, "group")
    assert "messaging.message.body.size" not in request_attributes(keyless, "group")


@pytest.mark.parametrize(("environ", "names"), [
    ({}, ["otlp_proto_http"]),
    ({"OTEL_TRACES_EXPORTER": "none"}, []),
    ({"OTEL_TRACES_EXPORTER": "console, otlp"}, ["console", "otlp_proto_http"]),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ["otlp_proto_grpc"]),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
     ["otlp_proto_http"]),
])
def test_exporters_follow_the_otel_environment(environ, names):
    assert exporter_names(environ) == names


def test_an_unknown_otlp_protocol_or_exporter_fails_at_open(monkeypatch):
    with pytest.raises(ConfigError, match="http/json"):
        exporter_names({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ConfigError, match="no span exporter 'zipkin'"):
        Tracing.open("group")


def test_open_builds_the_provider_from_the_environment(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "scorer")
    tracing = Tracing.open("group")
    try:
        assert tracing._provider.resource.attributes["service.name"] == "scorer"
    finally:
        tracing.close(1.0)
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    tracing = Tracing.open("group")
    assert tracing._provider.resource.attributes["service.name"] == "kinference"
    tracing.close(1.0)


class Squares(EchoHandler):
    """Echo that fails the micro-batch holding -1 in inference."""

    def inference(self, inputs):
        if any(item == -1 for item in inputs):
            raise RuntimeError("model exploded")
        return inputs


def serve(tracing: Tracing, records: list[FakeRecord], micro: int) -> list:
    """Decode, trace and run ``records`` through the real stages as one batch, then answer them."""
    handler = Squares()
    decoder = RequestDecoder("replies", 1000, handler.payload_format, tracing=tracing)
    requests = [decoder.decode(record) for record in records]
    for request in requests:
        if request.ok:
            request.item = request.payload
    pending: queue.Queue = queue.Queue()
    pending.put(requests)
    emitted, done = [], threading.Event()

    def next_batch(timeout_s, only_full):
        try:
            batch = pending.get(timeout=timeout_s)
        except queue.Empty:
            return []
        for request in batch:
            request.dispatched = time.monotonic()
        return batch

    def emit(finished):
        emitted.extend(finished)
        if len(emitted) == len(requests):
            done.set()

    batching = Batching(max_batch_size=len(requests), micro_batch_size=micro)
    run = ModelRun("m", handler, batching, InProcessInference(handler))
    pipeline = Pipeline(run, FakeBatches(next_batch), emit, Metrics(), tracing)
    pipeline.start()
    try:
        assert done.wait(10)
    finally:
        pipeline.stop(5)
    tracing.answered(emitted)
    return requests


def test_each_request_span_continues_its_callers_trace_and_links_to_its_batch(spans):
    provider, exporter = spans
    records = [FakeRecord(b"1", [(TRACEPARENT, CALLER)]), FakeRecord(b"2", [(TRACEPARENT, CALLER)]),
               FakeRecord(b"-1"), FakeRecord(b"{bad json")]
    requests = serve(Tracing(provider, "group"), records, micro=2)

    finished = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for span in finished:
        by_name.setdefault(span.name, []).append(span)
    batches = {span.context.span_id: span for span in by_name[BATCH_SPAN]}
    assert len(batches) == 2  # one per micro-batch
    request_spans = {span.attributes["messaging.kafka.offset"]: span for span in by_name["process requests"]}
    assert len(request_spans) == 4
    for request in requests:
        span = request_spans[request.offset]
        assert span.kind is SpanKind.CONSUMER
        assert span.attributes["messaging.message.conversation_id"] == request.correlation_id
        [link] = span.links
        batch = batches[link.context.span_id]
        assert batch.parent is None and batch.context.trace_id != TRACE_ID
        events = [event.name for event in span.events]
        assert events[0] == "dispatched"
        assert span.start_time <= batch.start_time <= span.events[0].timestamp
        assert batch.end_time <= span.end_time
    for offset in (records[0].offset(), records[1].offset()):
        span = request_spans[offset]
        assert (span.context.trace_id, span.parent.span_id) == (TRACE_ID, PARENT_ID)
        assert [event.name for event in span.events] == ["dispatched", "preprocess", "inference", "postprocess"]
        assert span.status.status_code is StatusCode.UNSET
    for name in ("preprocess", "inference", "postprocess"):
        assert {span.parent.span_id for span in by_name[name]} <= set(batches)
    root = request_spans[records[2].offset()]
    assert root.parent is None and root.context.trace_id != TRACE_ID

    # -1 made inference fail for its micro-batch; the bad JSON never reached the stages.
    failed = request_spans[records[2].offset()]
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes["error.type"] == "handler_error"
    assert [event.name for event in failed.events] == ["dispatched", "preprocess", "inference"]
    [broken] = [span for span in by_name["inference"] if span.status.status_code is StatusCode.ERROR]
    assert any(event.name == "exception" for event in broken.events)
    bad = request_spans[records[3].offset()]
    assert bad.status.status_code is StatusCode.ERROR and bad.attributes["error.type"] == "bad_request"
    assert "not valid JSON" in bad.status.description


def test_a_request_whose_span_cannot_start_is_served_untraced(spans, monkeypatch):
    provider, exporter = spans
    tracing = Tracing(provider, "group")
    monkeypatch.setattr("kinference.consumer.ops.tracing.request_attributes", lambda request, group: 1 / 0)
    request = RequestDecoder("replies", 1000, tracing=tracing).decode(FakeRecord(b"1", [(TRACEPARENT, CALLER)]))
    assert request.trace is not None
    tracing.answered([request])
    assert reply_headers(request, time.monotonic())  # still answerable
    assert exporter.get_finished_spans() == ()


def test_tracing_on_without_opentelemetry_fails_at_start_naming_the_extra(monkeypatch):
    for module in [name for name in sys.modules if name.startswith("opentelemetry") or
                   name == "kinference.consumer.ops.tracing"]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # what an install without the extra sees
    service = Service(ServiceConfig(handler="echo", tracing=True, metrics=False))
    with pytest.raises(ConfigError, match=r"pip install 'kinference\[otel\]'"):
        service.start()


def test_the_service_imports_no_opentelemetry_with_tracing_off():
    code = ("import sys; from kinference.consumer.service import Service; "
            "print(any(name.startswith('opentelemetry') for name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
