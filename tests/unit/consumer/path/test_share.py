"""Share groups (consumer/ledger/share.py, consumer/path/share.py): each record's acknowledgement follows its outcome,
and the poll thread alone calls the share consumer. The broker side runs in tests/faults/test_share_groups.py (Apache
Kafka)."""

from __future__ import annotations

import threading
import time

import pytest

from kinference.consumer.config import ServiceConfig, load_config
from kinference.consumer.delivery.answers import InFlight
from kinference.consumer.delivery.at_least_once import AtLeastOnce
from kinference.consumer.ledger.share import AcknowledgeType, ShareLedger
from kinference.consumer.ops.metrics import Metrics
from kinference.consumer.path.intake import Intake
from kinference.consumer.path.request import RequestDecoder
from kinference.consumer.path.share import ShareSource
from kinference.errors import ConfigError, RequestError
from kinference.protocol import ErrorCode
from tests.fakes import FakeModels, FakeRecord


class Record(FakeRecord):
    def error(self):
        return None


def requests_of(ledger: ShareLedger, count: int) -> list:
    models = FakeModels()
    intake = Intake(RequestDecoder("replies", 1000), ledger, models)
    intake.take([Record(b'{"n": %d}' % i, offset=i) for i in range(count)], on_error=lambda _: None)
    return models.routed


def test_at_least_once_settles_in_the_share_ledger_what_the_broker_acknowledged_and_holds_nothing_back():
    """The publisher's side of a share group (at_least_once.AtLeastOnce): answers go out in the turn that took them
    (nothing held for a transaction), and once acknowledged their records are settled in the ledger, for the source
    to acknowledge."""
    ledger = ShareLedger()
    mode = AtLeastOnce(ledger, "dead")
    ok, failed = requests_of(ledger, 2)
    ok.reply_value = b"{}"  # what the stages made of it
    failed.fail(RequestError("no", ErrorCode.HANDLER_ERROR))
    mode.take([ok, failed])
    deliveries = mode.begin(None, time.monotonic(), False)
    assert {delivery.request for delivery in deliveries} == {ok, failed} and ledger.in_flight == 2
    for delivery in deliveries:
        mode.delivered(delivery)
    assert mode.end(None, InFlight()).answered == [ok, failed] and ledger.in_flight == 0
    assert ledger.take() == [("requests", 0, 0, AcknowledgeType.ACCEPT), ("requests", 0, 1, AcknowledgeType.REJECT)]


def test_answered_records_are_accepted_failed_ones_rejected_and_abandoned_ones_released():
    ledger = ShareLedger()
    ok, failed, abandoned, _unanswered = requests_of(ledger, 4)
    failed.fail(RequestError("no", ErrorCode.HANDLER_ERROR))
    assert ledger.in_flight == 4
    ledger.finish([ok, failed])
    ledger.abandon([abandoned])
    ledger.finish([ok])  # a second report of the same record changes nothing
    assert ledger.take() == [("requests", 0, 0, AcknowledgeType.ACCEPT), ("requests", 0, 1, AcknowledgeType.REJECT),
                             ("requests", 0, 2, AcknowledgeType.RELEASE)]
    assert ledger.take() == [] and ledger.in_flight == 1 and not ledger.wait_idle(0.01)
    assert ledger.release_all() == [("requests", 0, 3, AcknowledgeType.RELEASE)]
    assert ledger.in_flight == 0 and ledger.wait_idle(0.01)


def test_exactly_once_is_refused_with_share_groups():
    with pytest.raises(ConfigError, match="share group has no offsets to commit"):
        load_config({"group_type": "share", "delivery": "exactly-once"}, environ={})


def test_the_share_consumer_gets_none_of_the_consumer_groups_defaults():
    config = ServiceConfig(group_type="share", kafka_consumer={"auto.offset.reset": "latest", "fetch.wait.max.ms": "5"})
    consumer = config.share_consumer_config()
    assert consumer["share.acknowledgement.mode"] == "explicit" and consumer["fetch.wait.max.ms"] == "5"
    assert not {"enable.auto.commit", "enable.auto.offset.store", "auto.offset.reset",
                "partition.assignment.strategy"} & consumer.keys()
    assert config.share_auto_offset_reset == "latest"
    assert ServiceConfig(group_type="share").share_auto_offset_reset == "earliest"


class FakeShareConsumer:
    """Refuses a poll while the previous one's records are unacknowledged, and any call from a second thread, as
    librdkafka's share consumer does."""

    def __init__(self, config):
        self.config = config
        self.batches = [[Record(b'{"n": %d}' % i, offset=i) for i in range(start, start + 3)] for start in (0, 3)]
        self.unacknowledged: set[int] = set()
        self.acknowledged: list[tuple[int, AcknowledgeType]] = []
        self.thread: threading.Thread | None = None
        self.closed = False

    def _call(self):
        self.thread = self.thread or threading.current_thread()
        assert threading.current_thread() is self.thread, "the share consumer was called from two threads"

    def subscribe(self, topics):
        pass

    def poll(self, timeout):
        self._call()
        assert not self.unacknowledged, f"poll with records unacknowledged: {self.unacknowledged}"
        if not self.batches:
            time.sleep(timeout)
            return []
        batch = self.batches.pop(0)
        self.unacknowledged = {record.offset() for record in batch}
        return batch

    def acknowledge_offset(self, topic, partition, offset, kind):
        self._call()
        self.unacknowledged.discard(offset)
        self.acknowledged.append((offset, kind))

    def commit_sync(self, timeout):
        self._call()

    def close(self):
        self._call()
        self.closed = True


def test_the_poll_thread_fetches_again_only_once_the_last_fetch_is_acknowledged():
    ledger, models = ShareLedger(), FakeModels()
    routed = models.routed
    intake = Intake(RequestDecoder("replies", 1000), ledger, models)
    metrics = Metrics()
    source = ShareSource(ServiceConfig(group_type="share", request_topics=["requests"]), intake, ledger, metrics,
                         consumer_factory=FakeShareConsumer)
    consumer = source._consumer
    source.start()
    deadline = time.monotonic() + 5
    while len(routed) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(routed) == 3, "fetched again before the first fetch was answered"
    ledger.finish(routed[:3])  # from this (the publisher's) thread: the poll thread acknowledges
    while len(routed) < 6:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ledger.finish(routed[3:4])
    source.drain(2)
    source.close(time.monotonic() + 5)
    assert consumer.closed and not source.alive
    assert consumer.acknowledged == [(0, AcknowledgeType.ACCEPT), (1, AcknowledgeType.ACCEPT),
                                     (2, AcknowledgeType.ACCEPT), (3, AcknowledgeType.ACCEPT),
                                     (4, AcknowledgeType.RELEASE), (5, AcknowledgeType.RELEASE)]
    counted = {kind: metrics.registry.get_sample_value("kinference_share_acknowledgements_total", {"kind": kind})
               for kind in ("accept", "release")}
    assert counted == {"accept": 4, "release": 2}  # observed once per kind and turn, each by its count


def test_kinferences_acknowledgement_numbers_are_librdkafkas():
    import confluent_kafka

    theirs = getattr(confluent_kafka, "AcknowledgeType", None)
    if theirs is None:
        pytest.skip("this confluent-kafka has no share consumer (an older release than 2.16)")
    assert {kind.name: int(kind) for kind in AcknowledgeType} == {name: int(getattr(theirs, name))
                                                                  for name in ("ACCEPT", "RELEASE", "REJECT")}
