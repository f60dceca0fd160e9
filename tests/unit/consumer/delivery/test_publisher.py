"""The publisher's delivery bookkeeping, with a fake producer (pure logic: no broker).

The suite runs against both delivery modes: whatever answers a request, and whatever replaces a refused record, is the
same in both; only when the answer becomes durable differs. Tests of one mode's own rules follow (exactly-once's
transactional contract is in ``test_transactions``)."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, TopicPartition

from kinference.consumer.delivery.answers import StreamChunk
from kinference.consumer.delivery.at_least_once import AtLeastOnce
from kinference.consumer.delivery.exactly_once import ExactlyOnce
from kinference.consumer.delivery.publisher import Publisher, PublishSettings
from kinference.consumer.ledger.commit import OffsetTracker
from kinference.consumer.ledger.commits import Transactions
from kinference.consumer.ledger.share import AcknowledgeType, ShareLedger
from kinference.consumer.ops.metrics import Metrics
from kinference.errors import RequestError
from kinference.protocol import ERROR_CODE, EVENT, ErrorCode, encode_result
from tests.fakes import FakeProducer, make_request, wait_for

P0 = ("requests", 0)
AT_LEAST_ONCE, EXACTLY_ONCE = "at-least-once", "exactly-once"


class Harness:
    """A started publisher with one delivery mode, its tracker, and what has become durable."""

    def __init__(self, mode: str, producers, **options) -> None:
        FakeProducer.instances.clear()
        self.mode = mode
        self.tracker = OffsetTracker()
        self.tracker.assign([P0])
        self.metrics = Metrics()
        delivery: AtLeastOnce | ExactlyOnce
        if mode == EXACTLY_ONCE:
            delivery = ExactlyOnce(self.tracker, Transactions(), "dead", self.metrics, commit_interval_s=0.05)
            config = {"transactional.id": "tid"}
        else:
            delivery = AtLeastOnce(self.tracker, "dead")
            config = {}
        factories = iter(producers)
        self.publisher = Publisher(config, delivery, PublishSettings("dead", queue_size=100, **options), self.metrics,
                                   producer_factory=lambda c: next(factories)(c))
        self.publisher.start()

    def request(self, offset: int, result=None, **fields):
        request = make_request({"x": offset}, offset=offset)
        request.reply_value = encode_result(result if result is not None else {"x": offset})
        request.ledger = self.tracker.track(P0, offset)
        for name, value in fields.items():
            setattr(request, name, value)
        return request

    @property
    def durable(self) -> int:
        """The position made durable: what the consumer would commit now, or what the last transaction did."""
        if self.mode == AT_LEAST_ONCE:
            positions = self.tracker.commit_offsets()
        else:
            positions = [TopicPartition(*tp) for producer in FakeProducer.instances
                         for _, offsets in producer.committed for tp in offsets]
        return max((tp.offset for tp in positions), default=0)

    @property
    def visible(self):
        return [message for producer in FakeProducer.instances for message in producer.visible]

    @property
    def aborts(self) -> float:
        return self.metrics.registry.get_sample_value("kinference_commit_failures_total")

    def stop(self) -> None:
        self.publisher.stop(5)


@pytest.fixture(params=[AT_LEAST_ONCE, EXACTLY_ONCE])
def mode(request):
    return request.param


def code_of(message) -> bytes | None:
    return dict(message.headers()).get(ERROR_CODE)


def test_a_request_is_answered_once_its_reply_and_dead_letter_are_delivered(mode):
    harness = Harness(mode, [FakeProducer])
    bad, good = harness.request(0), harness.request(1)
    bad.error, bad.dead_letter = RequestError("not json", ErrorCode.BAD_REQUEST), True
    harness.publisher.submit([bad, good])
    assert wait_for(lambda: harness.durable == 2)
    harness.stop()
    assert sorted(m.topic() for m in harness.visible) == ["dead", "replies", "replies"]


def test_an_undeliverable_reply_is_answered_by_a_dead_letter(mode):
    refused = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
    harness = Harness(mode, [lambda c: FakeProducer(c, fate={"nowhere": refused}.get)])
    harness.publisher.submit([harness.request(0, reply_topic="nowhere")])
    assert wait_for(lambda: harness.durable == 1)
    harness.stop()
    (dead,) = harness.visible
    assert dead.topic() == "dead" and code_of(dead) == b"internal_error"


def test_a_request_nothing_can_answer_is_counted_and_committed_past_and_the_service_goes_on(mode):
    """Issue 29, item 2: a request whose reply and dead letter were both refused for good stopped the service (exit
    1), and every start served it again and stopped again, its neighbours answered again each time. Producing the
    same records again would be refused again: it is an outcome of its own, and the commit passes it."""
    refused = {"nowhere": KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART),
               "dead": KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)}
    harness = Harness(mode, [lambda c: FakeProducer(c, fate=refused.get)])
    harness.publisher.submit([harness.request(0, reply_topic="nowhere"), harness.request(1)])
    assert wait_for(lambda: harness.durable == 2)
    assert harness.publisher.failure is None and harness.publisher.alive
    assert harness.metrics.registry.get_sample_value("kinference_unanswerable_requests_total") == 1
    harness.stop()
    (reply,) = harness.visible
    assert reply.topic() == "replies" and code_of(reply) is None


def test_a_record_that_timed_out_is_produced_again_not_dead_lettered(mode):
    """_MSG_TIMED_OUT after a long broker outage is not the record's fault: the same reply goes out again (after a
    backoff, or in the next transaction)."""
    failures = iter([KafkaError(KafkaError._MSG_TIMED_OUT), KafkaError(KafkaError._PURGE_QUEUE)])
    harness = Harness(mode, [lambda c: FakeProducer(c, fate=lambda t: next(failures, None))])
    harness.publisher.submit([harness.request(0)])
    assert wait_for(lambda: harness.durable == 1, timeout_s=10)  # backoff 0.5 s, then 1 s
    harness.stop()
    (reply,) = harness.visible
    assert reply.topic() == "replies" and code_of(reply) is None and harness.publisher.failure is None


def test_a_result_too_large_for_the_broker_becomes_a_small_error_reply_without_an_abort(mode):
    """Refused by produce() itself, the record never entered a transaction: its replacement goes into the same one
    (issue 20, defect 3: an oversized reply must not abort the transaction of every other reply)."""
    too_large = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    harness = Harness(mode, [lambda c: FakeProducer(c, refuse=lambda value: too_large if len(value) > 500 else None)])
    large, fine = harness.request(0, result={"x": "y" * 1000}), harness.request(1)
    harness.publisher.submit([large, fine])
    assert wait_for(lambda: harness.durable == 2)
    harness.stop()
    small, other = sorted(harness.visible, key=lambda m: m.value())
    assert code_of(small) == b"handler_error" and b"too large" in small.value() and code_of(other) is None
    assert harness.aborts == 0


def test_a_reply_partition_the_topic_lacks_gets_bad_request_on_the_default_partition(mode):
    """Issue 20, defect 3: under exactly-once, such a reply was refused by the broker and aborted the transaction
    with every other reply in it, over and over. It is checked against the topic's metadata first."""
    harness = Harness(mode, [lambda c: FakeProducer(c, partitions={"replies": 2})])
    asked_too_far, fine = harness.request(0, reply_partition=7), harness.request(1, reply_partition=1)
    harness.publisher.submit([asked_too_far, fine])
    assert wait_for(lambda: harness.durable == 2)
    harness.stop()
    refused, answered = sorted(harness.visible, key=lambda m: m.partition())
    assert code_of(refused) == b"bad_request" and b"reply partition 7 does not exist" in refused.value()
    assert refused.partition() == -1  # the default: by key
    assert code_of(answered) is None and answered.partition() == 1
    assert harness.aborts == 0 and harness.publisher.failure is None


def test_a_record_whose_headers_cannot_be_read_is_answered_by_its_dead_letter_only(mode):
    harness = Harness(mode, [FakeProducer])
    request = harness.request(0, dead_letter=True, unroutable=True)
    request.error = RequestError("headers", ErrorCode.BAD_REQUEST)
    harness.publisher.submit([request])
    assert wait_for(lambda: harness.durable == 1)
    harness.stop()
    assert [m.topic() for m in harness.visible] == ["dead"]


# --- at-least-once: refused records retried one by one, and a dead producer replaced


def test_stream_chunks_go_out_before_their_final_only_where_the_delivery_mode_streams(mode):
    """Issue 37: a generative request's chunks go through the delivery mode like its final. At-least-once produces
    them as they come; exactly-once none (a transactional producer writes only inside a transaction)."""
    harness = Harness(mode, [FakeProducer])
    request = harness.request(0, reply_partition=1)
    harness.publisher.stream([StreamChunk(request, b"chunk", [(EVENT, b"delta")])])
    harness.publisher.submit([request])
    assert wait_for(lambda: harness.durable == 1)
    harness.stop()
    streams = mode == AT_LEAST_ONCE
    assert harness.publisher.streams is streams
    produced = [message for producer in FakeProducer.instances for message in producer.delivered]
    records = [(m.value(), m.partition(), dict(m.headers()).get(EVENT)) for m in produced]
    final = (encode_result({"x": 0}), 1, None)
    assert records == ([(b"chunk", 1, b"delta"), final] if streams else [final])


def test_transient_failures_past_the_retry_timeout_stop_the_service():
    timed_out = KafkaError(KafkaError._MSG_TIMED_OUT)
    harness = Harness(AT_LEAST_ONCE, [lambda c: FakeProducer(c, fate=lambda t: timed_out)],
                      delivery_retry_timeout_s=0.3)
    harness.publisher.submit([harness.request(0)])
    assert wait_for(lambda: harness.publisher.failure is not None, timeout_s=10)
    assert "still failed after 0.3 s" in harness.publisher.failure and harness.durable == 0
    harness.stop()


def test_a_fatal_producer_is_replaced_and_undelivered_records_are_produced_again():
    fenced = KafkaError(KafkaError.UNKNOWN_PRODUCER_ID, fatal=True)
    harness = Harness(AT_LEAST_ONCE, [lambda c: FakeProducer(c, fatal=fenced), FakeProducer])
    harness.publisher.submit([harness.request(i) for i in range(5)])
    assert wait_for(lambda: harness.durable == 5)
    harness.publisher.submit([harness.request(5)])
    assert wait_for(lambda: harness.durable == 6)
    assert harness.publisher.alive
    harness.stop()
    first, second = FakeProducer.instances
    assert first.delivered == [] and len(second.delivered) == 6
    registry = harness.metrics.registry
    assert registry.get_sample_value("kinference_fatal_errors_total", {"client": "producer"}) >= 1
    assert registry.get_sample_value("kinference_producer_replacements_total") == 1


class SilentProducer(FakeProducer):
    """Accepts records and never reports on them (librdkafka retrying UNKNOWN_PRODUCER_ID forever); a flush
    reports ``on_flush`` of them as purged, and the others never."""

    def __init__(self, config, on_flush: int | None = None, **kwargs):
        super().__init__(config, **kwargs)
        self.on_flush = on_flush

    def poll(self, timeout=0):
        if self.fatal is not None:
            self.error_cb(self.fatal)
        return 0

    def flush(self, timeout=0):
        reported = self.queued[:self.on_flush]
        self.queued = self.queued[len(reported):]
        for message, on_delivery in reported:
            on_delivery(KafkaError(KafkaError._PURGE_QUEUE), message)
        return len(self.queued)


def test_a_stalled_producer_is_replaced_and_its_records_produced_again():
    harness = Harness(AT_LEAST_ONCE, [SilentProducer, FakeProducer], stall_timeout_s=0.3)
    harness.publisher.submit([harness.request(i) for i in range(3)])
    assert wait_for(lambda: harness.durable == 3)
    harness.stop()
    _stalled, replacement = FakeProducer.instances
    assert len(replacement.delivered) == 3


def test_records_a_replaced_producer_never_reported_are_produced_again():
    """Issue 20: the replaced producer is flushed for 1 s; what it has not reported by then (a report it would give
    later, or never) must not leave its request unanswered while /healthz stays 200."""
    fenced = KafkaError(KafkaError.UNKNOWN_PRODUCER_ID, fatal=True)
    harness = Harness(AT_LEAST_ONCE, [lambda c: SilentProducer(c, on_flush=2, fatal=fenced), FakeProducer])
    harness.publisher.submit([harness.request(i) for i in range(5)])
    assert wait_for(lambda: harness.durable == 5)
    harness.stop()
    silent, replacement = FakeProducer.instances
    assert len(silent.queued) == 3  # never reported
    assert sorted(m.value() for m in replacement.delivered) == sorted(encode_result({"x": i}) for i in range(5))


def test_what_fails_in_delivery_is_the_delivery_s_outcome_and_the_request_is_left_as_it_came():
    """Issue 37: delivery writes no ``Request``. A reply partition the topic lacks, a result too large to publish and
    a request nothing can answer are the delivery's outcome: the replies, the metrics and a share group's
    acknowledgements say so as before, and the requests keep their own (no) error and reply partition."""
    FakeProducer.instances.clear()
    refused = {"nowhere": KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART),
               "dead": KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)}
    too_large = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    ledger, metrics = ShareLedger(), Metrics()
    publisher = Publisher({}, AtLeastOnce(ledger, "dead"), PublishSettings("dead", queue_size=10), metrics,
                          producer_factory=lambda c: FakeProducer(c, fate=refused.get, partitions={"replies": 2},
                                                                  refuse=lambda v: too_large if len(v) > 500 else None))
    publisher.start()
    requests = [make_request({}, offset=offset) for offset in range(4)]
    misdirected, large, unanswerable, _fine = requests
    misdirected.reply_partition, unanswerable.reply_topic = 7, "nowhere"
    for request in requests:
        request.reply_value = encode_result({"y": "z" * 1000} if request is large else {})
    for request, marker in zip(requests, ledger.track_fetch([(P0, r.offset) for r in requests]), strict=True):
        request.ledger = marker
    publisher.submit(requests)
    assert wait_for(lambda: ledger.in_flight == 0)
    publisher.stop(5)
    outcomes = {offset: kind for _, _, offset, kind in ledger.take()}
    assert outcomes == {0: AcknowledgeType.REJECT, 1: AcknowledgeType.REJECT, 2: AcknowledgeType.REJECT,
                        3: AcknowledgeType.ACCEPT}
    assert all(request.ok for request in requests) and misdirected.reply_partition == 7
    sample = metrics.registry.get_sample_value
    assert sample("kinference_replies_total", {"status": "error"}) == 2
    assert sample("kinference_replies_total", {"status": "ok"}) == 1
    assert sample("kinference_requests_total", {"model": "none", "topic": "requests", "outcome": "bad_request"}) == 1
    assert sample("kinference_unanswerable_requests_total") == 1
