"""Offsets with gaps (issue 29, item 1): request topics written by transactional producers (their commit and abort
markers, and under read_committed the records of aborted transactions, take offsets no record is handed over for),
and compacted request topics. Apache Kafka only: Tansu shows aborted records to read_committed readers and does
not compact."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable

import orjson
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from kinference import protocol
from kinference.consumer.ops.topics import create_topics
from kinference.consumer.service import Service
from tests.integration.kafka_io import committed, headers_of, produce, read, service_config

pytestmark = pytest.mark.integration

READ_COMMITTED = {"isolation.level": "read_committed"}
DELIVERY_MODES = pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])


@pytest.fixture
def kafka(broker):
    if broker.kind != "kafka":
        pytest.skip(f"the {broker.kind} broker shows aborted records to read_committed readers and does not compact: "
                    "run with KINFERENCE_TEST_BROKER=kafka")
    return broker


def request(name: str, key: bytes | None = None) -> tuple[bytes | None, bytes, list]:
    return key, orjson.dumps(name), [(protocol.CORRELATION_ID, name.encode())]


def produce_in_transaction(bootstrap: str, topic: str, records: list, *, commit: bool) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"upstream-{uuid.uuid4().hex[:8]}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for key, value, headers in records:
        producer.produce(topic, value, key, headers=headers)
    producer.flush(30)  # in the log before the end: an abort would purge records still queued in the client
    if commit:
        producer.commit_transaction(30)
    else:
        producer.abort_transaction(30)


def end_offset(bootstrap: str, topic: str, at_least: int = 0, timeout_s: float = 10.0) -> int:
    """The end offset of ``topic``'s partition 0, once it is ``at_least``: a transaction's markers are written after
    ``commit_transaction`` returns. Read uncommitted: a read_committed high watermark stops at an open transaction."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"watermarks-{uuid.uuid4().hex[:8]}",
                         "isolation.level": "read_uncommitted"})
    deadline = time.monotonic() + timeout_s
    try:
        while (end := consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1]) < at_least:
            assert time.monotonic() < deadline, f"{topic} ends at {end}, not {at_least}"
            time.sleep(0.1)
        return end
    finally:
        consumer.close()


def wait_committed(bootstrap: str, group_id: str, topic: str, offset: int, timeout_s: float = 30.0) -> int:
    """The group's committed offset of ``topic``'s partition 0, once it is ``offset`` (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = committed(bootstrap, group_id, [(topic, 0)])[(topic, 0)]
        if now == offset or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def served(bootstrap: str, topics: dict[str, str], expected: int, delivery: str,
           write: Callable[[], int]) -> tuple[Counter, int, int]:
    """Serve the request topic while ``write()`` writes to it and returns its end offset: the replies by correlation
    id, the end offset and the offset committed once it is reached (or after a timeout)."""
    config = service_config(bootstrap, topics, delivery=delivery, commit_interval_ms=100)
    with Service(config) as service:
        assert service.wait_ready(60)
        end = write()
        replies = read(bootstrap, topics["replies"], expected, settle_s=1.0, **READ_COMMITTED)
        position = wait_committed(bootstrap, config.group_id, topics["requests"], end)
        assert service.healthy
    return Counter(headers_of(m)[protocol.CORRELATION_ID].decode() for m in replies), end, position


@DELIVERY_MODES
def test_a_transactional_upstream_is_served_and_committed_to_the_end(kafka, delivery):
    """The review's reproduction: after 10 plain requests, 3 transactions of 5 and 20 plain requests, the commit
    stopped for good at the first transaction's marker (15), and a restart answered 25-30 requests again; under
    exactly-once, the requests after the marker were held unanswered. Here one transaction aborts, and the log ends
    with a transaction's marker, which a fetch of its own brings, after the transaction's records."""
    bootstrap = kafka.bootstrap_servers
    topics = kafka.topics(requests=1, replies=1, dead=1)

    def write() -> int:
        plain = [request(f"plain-{i}") for i in range(30)]
        produce(bootstrap, topics["requests"], plain[:10])
        for name, commit in [("committed", True), ("aborted", False), ("more", True)]:
            produce_in_transaction(bootstrap, topics["requests"], [request(f"{name}-{i}") for i in range(5)],
                                   commit=commit)
        produce(bootstrap, topics["requests"], plain[10:])
        produce_in_transaction(bootstrap, topics["requests"], [request(f"last-{i}") for i in range(5)], commit=True)
        return end_offset(bootstrap, topics["requests"], at_least=30 + 4 * 6)  # each transaction: 5 and a marker

    by_id, end, position = served(bootstrap, topics, 45, delivery, write)
    assert end == 30 + 4 * 6
    assert set(by_id.values()) == {1}, "each request answered once"
    assert len(by_id) == 45 and not any(name.startswith("aborted") for name in by_id)
    assert position == end, "the commit reaches the end of the log, across every marker and aborted record"


def compacted_requests(bootstrap: str, kafka) -> dict[str, str]:
    """A compacted request topic with gaps: 40 records, every other one of the same key, compacted to the 21 last
    records of their keys (and the records that rolled the segments, of one more key). The log cleaner looks for
    work every 0.2 s on the test broker (``apache_kafka.BROKER_DEFAULTS``)."""
    topics = kafka.topics(replies=1, dead=1)
    topics["requests"] = f"compacted-{uuid.uuid4().hex[:10]}"
    create_topics(bootstrap, {topics["requests"]: 1}, topic_config={
        "cleanup.policy": "compact", "segment.ms": "100", "min.cleanable.dirty.ratio": "0.01"})
    produce(bootstrap, topics["requests"], [request(f"r-{i}", key=b"dup" if i % 2 else b"u%d" % i) for i in range(40)])
    deadline = time.monotonic() + 60
    while (left := sum(1 for m in read(bootstrap, topics["requests"], 41, timeout_s=1.0) if m.key() != b"roll")) > 21:
        assert time.monotonic() < deadline, f"the topic was not compacted: {left} of 40 records are left"
        time.sleep(0.2)  # the active segment, never compacted, rolls at the next record after segment.ms
        produce(bootstrap, topics["requests"], [request("roll", key=b"roll")])
    return topics


@DELIVERY_MODES
def test_a_compacted_request_topic_is_served_and_committed_to_the_end(kafka, delivery):
    bootstrap = kafka.bootstrap_servers
    topics = compacted_requests(bootstrap, kafka)
    remaining = read(bootstrap, topics["requests"], 22, timeout_s=5.0)
    offsets = [m.offset() for m in remaining]
    assert offsets != list(range(offsets[0], offsets[0] + len(offsets))), "compaction left gaps"
    end = end_offset(bootstrap, topics["requests"])
    by_id, _, position = served(bootstrap, topics, len(remaining), delivery, lambda: end)
    assert by_id == Counter(headers_of(m)[protocol.CORRELATION_ID].decode() for m in remaining)
    assert position == end
