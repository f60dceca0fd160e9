"""The publisher's delivery bookkeeping, with a fake producer (pure logic: no broker)."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException

from kinference.consumer.metrics import Metrics
from kinference.consumer.publisher import Publisher
from kinference.errors import RequestError
from kinference.protocol import ErrorCode, encode_result
from tests.fakes import make_request, wait_for


class FakeMessage:
    def __init__(self, topic, value, key, headers, partition):
        self._fields = (topic, value, key, headers, partition)

    def topic(self):
        return self._fields[0]

    def value(self):
        return self._fields[1]

    def key(self):
        return self._fields[2]

    def headers(self):
        return self._fields[3]

    def partition(self):
        return self._fields[4]


class FakeProducer:
    """Delivers on poll; ``fate(topic)`` says which error (or None) each record gets."""

    instances: list[FakeProducer] = []

    def __init__(self, config, fate=lambda topic: None, fatal=None, refuse=lambda value: None):
        """``refuse(value)``: the error produce() raises at once for that value (too large), or None."""
        self.error_cb = config["error_cb"]
        self.fate, self.fatal, self.refuse = fate, fatal, refuse
        self.queued, self.delivered = [], []
        FakeProducer.instances.append(self)

    def produce(self, topic, value, key, headers=None, on_delivery=None, partition=-1):
        refused = self.refuse(value or b"")
        if refused is not None:
            raise KafkaException(refused)
        self.queued.append((FakeMessage(topic, value, key, headers, partition), on_delivery))

    def poll(self, timeout=0):
        if self.fatal is not None:
            self.error_cb(self.fatal)
        queued, self.queued = self.queued, []
        for message, on_delivery in queued:
            err = self.fatal or self.fate(message.topic())
            if err is None:
                self.delivered.append(message)
            on_delivery(err, message)
        return 0

    def flush(self, timeout=0):
        self.poll()
        return 0

    def purge(self, **_):
        pass

    def __len__(self):
        return len(self.queued)


def start_publisher(factories):
    answered = []
    factories = iter(factories)
    publisher = Publisher({}, "dead", answered.extend, queue_size=100, metrics=Metrics(),
                          producer_factory=lambda config: next(factories)(config))
    publisher.start()
    return publisher, answered


def ok_request(**kwargs):
    request = make_request({"x": 1}, **kwargs)
    request.reply_value = encode_result({"x": 1})
    return request



def test_request_is_answered_only_after_reply_and_dead_letter_are_delivered():
    FakeProducer.instances.clear()
    publisher, answered = start_publisher([FakeProducer])
    bad = make_request()
    bad.error, bad.dead_letter = RequestError("not json", ErrorCode.BAD_REQUEST), True
    good = ok_request()
    publisher.submit([bad, good])
    assert wait_for(lambda: len(answered) == 2)
    publisher.stop(5)
    topics = sorted(m.topic() for m in FakeProducer.instances[0].delivered)
    assert topics == ["dead", "replies", "replies"]


def test_undeliverable_reply_goes_to_the_dead_letter_topic_then_counts_as_answered():
    FakeProducer.instances.clear()
    refused = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
    fate = {"nowhere": refused}.get
    publisher, answered = start_publisher([lambda c: FakeProducer(c, fate=fate)])
    request = ok_request()
    request.reply_topic = "nowhere"
    publisher.submit([request])
    assert wait_for(lambda: answered == [request])
    publisher.stop(5)
    (dead,) = FakeProducer.instances[0].delivered
    assert dead.topic() == "dead" and dict(dead.headers())["kinference-error-code"] == b"internal_error"


def test_a_request_nothing_can_answer_stays_unanswered_and_stops_the_service():
    FakeProducer.instances.clear()
    refused = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    publisher, answered = start_publisher([lambda c: FakeProducer(c, fate=lambda t: refused)])
    publisher.submit([ok_request()])
    assert wait_for(lambda: publisher.failure is not None)
    assert "cannot be answered" in publisher.failure and "dead" in publisher.failure
    assert wait_for(lambda: not publisher.alive)  # /healthz fails; the service exits non-zero
    publisher.stop(5)
    assert answered == []  # so its offset is never committed


def test_a_record_that_timed_out_is_produced_again_not_dead_lettered():
    """_MSG_TIMED_OUT after a long broker outage is not the record's fault: the same reply goes out again."""
    FakeProducer.instances.clear()
    failures = iter([KafkaError(KafkaError._MSG_TIMED_OUT), KafkaError(KafkaError._PURGE_QUEUE)])
    publisher, answered = start_publisher([lambda c: FakeProducer(c, fate=lambda t: next(failures, None))])
    request = ok_request()
    publisher.submit([request])
    assert wait_for(lambda: answered == [request], timeout_s=10)  # backoff 0.5 s, then 1 s
    publisher.stop(5)
    (reply,) = FakeProducer.instances[0].delivered
    assert reply.topic() == "replies" and publisher.failure is None


def test_transient_failures_past_the_retry_timeout_stop_the_service():
    FakeProducer.instances.clear()
    answered = []
    timed_out = KafkaError(KafkaError._MSG_TIMED_OUT)
    publisher = Publisher({}, "dead", answered.extend, queue_size=10, metrics=Metrics(), delivery_retry_timeout_s=0.3,
                          producer_factory=lambda c: FakeProducer(c, fate=lambda t: timed_out))
    publisher.start()
    publisher.submit([ok_request()])
    assert wait_for(lambda: publisher.failure is not None, timeout_s=10)
    assert "still failed after 0.3 s" in publisher.failure and answered == []
    publisher.stop(5)


def test_a_result_too_large_for_the_broker_becomes_a_small_error_reply():
    FakeProducer.instances.clear()
    too_large = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    publisher, answered = start_publisher(
        [lambda c: FakeProducer(c, refuse=lambda value: too_large if len(value) > 500 else None)])
    request = make_request()
    request.reply_value = encode_result({"x": "y" * 1000})
    publisher.submit([request])
    assert wait_for(lambda: answered == [request])
    publisher.stop(5)
    (reply,) = FakeProducer.instances[0].delivered
    assert dict(reply.headers())["kinference-error-code"] == b"handler_error" and b"too large" in reply.value()


def test_a_record_whose_headers_cannot_be_read_is_answered_by_its_dead_letter_only():
    FakeProducer.instances.clear()
    publisher, answered = start_publisher([FakeProducer])
    request = make_request()
    request.error, request.dead_letter, request.unroutable = RequestError("headers", ErrorCode.BAD_REQUEST), True, True
    publisher.submit([request])
    assert wait_for(lambda: answered == [request])
    publisher.stop(5)
    assert [m.topic() for m in FakeProducer.instances[0].delivered] == ["dead"]


def test_fatal_producer_is_replaced_and_undelivered_records_are_produced_again():
    FakeProducer.instances.clear()
    fenced = KafkaError(KafkaError.UNKNOWN_PRODUCER_ID, fatal=True)
    publisher, answered = start_publisher([lambda c: FakeProducer(c, fatal=fenced), FakeProducer])
    requests = [ok_request(offset=i) for i in range(5)]
    publisher.submit(requests)
    assert wait_for(lambda: len(answered) == 5)
    later = ok_request(offset=99)
    publisher.submit([later])
    assert wait_for(lambda: len(answered) == 6)
    assert publisher.alive
    publisher.stop(5)
    first, second = FakeProducer.instances
    assert first.delivered == [] and len(second.delivered) == 6
    registry = publisher._metrics.registry
    assert registry.get_sample_value("kinference_fatal_errors_total", {"client": "producer"}) >= 1
    assert registry.get_sample_value("kinference_producer_replacements_total") == 1
    assert sorted(r.offset for r in answered) == [0, 1, 2, 3, 4, 99]


class SilentProducer(FakeProducer):
    """Accepts records and never reports on them (librdkafka retrying UNKNOWN_PRODUCER_ID forever)."""

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=0):
        queued, self.queued = self.queued, []
        for message, on_delivery in queued:
            on_delivery(KafkaError(KafkaError._PURGE_QUEUE), message)
        return 0

    def __len__(self):
        return len(self.queued)


def test_stalled_producer_is_replaced_and_its_records_produced_again():
    FakeProducer.instances.clear()
    answered = []
    factories = iter([SilentProducer, FakeProducer])
    publisher = Publisher({}, "dead", answered.extend, queue_size=100, metrics=Metrics(), stall_timeout_s=0.3,
                          producer_factory=lambda config: next(factories)(config))
    publisher.start()
    publisher.submit([ok_request(offset=i) for i in range(3)])
    assert wait_for(lambda: len(answered) == 3)
    publisher.stop(5)
    _stalled, replacement = FakeProducer.instances
    assert len(replacement.delivered) == 3
