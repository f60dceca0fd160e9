"""OpenTelemetry tracing through a real broker: the caller's trace goes through the service and back in the reply."""

from __future__ import annotations

import orjson
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.trace import SpanKind, StatusCode

from kinference import protocol
from kinference.consumer.ops.tracing import BATCH_SPAN, TRACEPARENT
from kinference.consumer.service import Service
from tests.integration.kafka_io import headers_of, produce, read, service_config

pytestmark = pytest.mark.integration

READY_S = 30
COUNT = 12
STAGES = ["preprocess", "inference", "postprocess"]


def caller(i: int) -> tuple[int, int, bytes]:
    """A caller's trace and span id for request ``i``, and its traceparent."""
    trace_id, span_id = 0xA0000000000000000000000000000000 + i, 0xB000000000000000 + i
    return trace_id, span_id, f"00-{trace_id:032x}-{span_id:016x}-01".encode()


def requests(bad: int) -> list[tuple[bytes, bytes, list]]:
    return [(f"key-{i}".encode(), b"{not json" if i == bad else orjson.dumps({"i": i}),
             [(protocol.CORRELATION_ID, f"req-{i}".encode()), (TRACEPARENT, caller(i)[2])]) for i in range(COUNT)]


def serve(broker, topics, provider, records, **overrides):
    config = service_config(broker.bootstrap_servers, topics, max_batch_size=8, micro_batch_size=4, **overrides)
    with Service(config, tracer_provider=provider) as service:
        assert service.wait_ready(READY_S)
        produce(broker.bootstrap_servers, topics["requests"], records)
        replies = read(broker.bootstrap_servers, topics["replies"], len(records))
    assert len(replies) == len(records)
    return {headers_of(reply)[protocol.CORRELATION_ID].decode(): reply for reply in replies}


def test_the_callers_trace_goes_through_the_service_and_back_in_the_reply(broker, spans):
    provider, exporter = spans
    topics = broker.topics(requests=2, replies=1, dead=1)
    bad = 5
    replies = serve(broker, topics, provider, requests(bad), tracing=True)

    finished = exporter.get_finished_spans()
    batches = {span.context.span_id: span for span in finished if span.name == BATCH_SPAN}
    stage_spans = [span for span in finished if span.name in STAGES]
    by_id = {span.attributes["messaging.message.conversation_id"]: span for span in finished
             if span.name == f"process {topics['requests']}"}
    assert len(by_id) == COUNT
    assert batches and all(span.parent.span_id in batches for span in stage_spans)
    for i in range(COUNT):
        trace_id, parent_id, _ = caller(i)
        span = by_id[f"req-{i}"]
        assert span.kind is SpanKind.CONSUMER
        assert (span.context.trace_id, span.parent.span_id) == (trace_id, parent_id)
        assert span.attributes["messaging.system"] == "kafka"
        assert span.attributes["messaging.destination.name"] == topics["requests"]
        assert span.attributes["messaging.kafka.message.key"] == f"key-{i}"
        reply = headers_of(replies[f"req-{i}"])
        assert reply[TRACEPARENT] == f"00-{trace_id:032x}-{span.context.span_id:016x}-01".encode()
        assert all(span.start_time <= event.timestamp <= span.end_time for event in span.events)
        if i == bad:
            assert span.status.status_code is StatusCode.ERROR
            assert span.attributes["error.type"] == "bad_request"
            assert not span.links and not span.events  # never batched
            continue
        assert span.status.status_code is StatusCode.UNSET
        [link] = span.links
        batch = batches[link.context.span_id]
        assert [event.name for event in span.events] == ["dispatched", *STAGES]
        own_stages = sorted((stage for stage in stage_spans if stage.parent.span_id == batch.context.span_id),
                            key=lambda stage: stage.start_time)
        assert [stage.name for stage in own_stages] == STAGES
        assert span.start_time <= batch.start_time <= own_stages[0].start_time
        assert own_stages[-1].end_time <= batch.end_time <= span.end_time


def test_with_tracing_off_nothing_is_recorded_and_replies_carry_no_trace_context(broker, spans):
    provider, exporter = spans
    topics = broker.topics(requests=1, replies=1, dead=1)
    replies = serve(broker, topics, provider, requests(bad=-1))
    assert exporter.get_finished_spans() == ()
    assert not any(TRACEPARENT in headers_of(reply) for reply in replies.values())
