"""librdkafka's built-in mock cluster, for what the embedded broker cannot show (KIP-848's consumer group protocol).

``test.mock.num.brokers`` makes a librdkafka client start a real Kafka protocol implementation in-process, its
brokers listening on loopback TCP ports; other clients (``kinference serve`` processes included) connect to
them like to any broker. It lives as long as the client that started it. It supports the consumer group
protocols, transactions and topic auto-creation (4 partitions each), but not CreateTopics.
"""

from __future__ import annotations

import io
import logging
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from confluent_kafka import Producer

PARTITIONS = 4
"""Partitions of every topic the mock cluster creates."""


@dataclass(frozen=True)
class MockBroker:
    bootstrap_servers: str
    kind: str = "mock"

    def topics(self, **roles: int) -> dict[str, str]:
        """Uniquely named topics, as ``TestBroker.topics``; each has ``PARTITIONS`` partitions, whatever is asked."""
        names = {role: f"{role}-{uuid.uuid4().hex[:10]}" for role in roles}
        probe = Producer({"bootstrap.servers": self.bootstrap_servers})
        for name in names.values():
            topic = probe.list_topics(topic=name, timeout=10).topics[name]  # a metadata request creates it
            if topic.error is not None or len(topic.partitions) != PARTITIONS:
                raise RuntimeError(f"the mock cluster did not create {name}: {topic.error}")
        return names


@contextmanager
def mock_cluster(brokers: int = 3, start_timeout_s: float = 10.0) -> Iterator[MockBroker]:
    logs = io.StringIO()
    logger = logging.getLogger(f"mock-cluster-{uuid.uuid4().hex[:6]}")
    logger.addHandler(logging.StreamHandler(logs))
    logger.setLevel(logging.INFO)
    logger.propagate = False
    anchor = Producer({"bootstrap.servers": "unused:9092", "test.mock.num.brokers": str(brokers), "logger": logger})
    deadline = time.monotonic() + start_timeout_s
    while (match := re.search(r"replaced with (\S+)", logs.getvalue())) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the mock cluster did not start: {logs.getvalue()[-500:]}")
        anchor.poll(0.05)
    try:
        yield MockBroker(match.group(1))
    finally:
        anchor.flush(1)
