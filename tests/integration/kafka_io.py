"""Plain confluent-kafka helpers for integration tests: produce requests, read replies, read offsets."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, Producer, TopicPartition

from kinference.consumer.config import ServiceConfig
from tests.conftest import TEST_CONSUMER_PROPERTIES


def service_config(bootstrap: str, topics: dict[str, str], **overrides: Any) -> ServiceConfig:
    values = {
        "bootstrap_servers": bootstrap,
        "request_topics": [topics["requests"]],
        "reply_topic": topics["replies"],
        "dead_letter_topic": topics["dead"],
        "group_id": f"kinference-test-{uuid.uuid4().hex[:8]}",
        "handler": "echo",
        "kafka_consumer": TEST_CONSUMER_PROPERTIES,
        "commit_interval_ms": 200,
        "lag_interval_s": 0.5,
        "metrics": False,  # tests that scrape pass metrics=True, metrics_port=0 (any free port)
        **overrides,
    }
    return ServiceConfig(**values)


@dataclass
class Produced:
    """Where each produced record landed: ``ends[(topic, partition)]`` is that partition's end offset."""

    ends: Counter

    @property
    def total(self) -> int:
        return sum(self.ends.values())


def produce(bootstrap: str, topic: str, records: list[tuple[bytes | None, bytes | None, list]],
            **config: Any) -> Produced:
    """Produce ``(key, value, headers)`` records; count them per partition from delivery reports
    (Tansu's "latest" offset is not reliable for multi-record batches)."""
    ends: Counter = Counter()
    errors = []

    def delivered(err, msg):
        if err is not None:
            errors.append(err)
        else:
            ends[(msg.topic(), msg.partition())] += 1

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, **config})
    for key, value, headers in records:
        while True:
            try:
                producer.produce(topic, value, key, headers=headers, on_delivery=delivered)
                break
            except BufferError:
                producer.poll(0.1)
    assert producer.flush(30) == 0, "produce did not finish"
    assert not errors, errors
    return Produced(ends)


def read(bootstrap: str, topic: str, count: int, timeout_s: float = 60.0, settle_s: float = 0.0,
         partitions: list[int] | None = None, **config: str) -> list[Message]:
    """Read ``topic`` from the beginning by assignment until ``count`` records arrived (or timeout),
    then keep reading ``settle_s`` more so that extra (duplicate) records would show up too."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": "false", "fetch.wait.max.ms": "10", **config})
    try:
        if partitions is None:
            partitions = list(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        records: list[Message] = []
        deadline = time.monotonic() + timeout_s
        settle_until = None
        while time.monotonic() < (settle_until or deadline):
            for message in consumer.consume(500, 0.1):
                if message.error() is None:
                    records.append(message)
            if settle_until is None and len(records) >= count:
                settle_until = time.monotonic() + settle_s
        return records
    finally:
        consumer.close()


def headers_of(message: Message) -> dict[str, bytes]:
    return dict(message.headers() or [])


def committed(bootstrap: str, group_id: str, partitions: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group_id})
    try:
        offsets = consumer.committed([TopicPartition(t, p) for t, p in partitions], timeout=10)
        return {(tp.topic, tp.partition): tp.offset for tp in offsets}
    finally:
        consumer.close()
