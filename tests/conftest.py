"""Shared fixtures: one real broker per test session, unique topic and group names per test.

The broker is the embedded Tansu broker by default. With ``KINFERENCE_TEST_BROKER=kafka`` (and a Docker
engine) the same tests run against Apache Kafka started by testcontainers.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from kinference.consumer.broker import EmbeddedBroker, create_topics

# Settings that keep tests fast on any broker: Tansu holds a group join for ~session.timeout.ms / 2.
TEST_CONSUMER_PROPERTIES = {
    "session.timeout.ms": "6000",
    "heartbeat.interval.ms": "2000",
}


@dataclass(frozen=True)
class TestBroker:
    bootstrap_servers: str
    kind: str

    def topics(self, **partitions: int) -> dict[str, str]:
        """Create uniquely named topics: ``topics(requests=3)`` -> ``{"requests": "requests-1a2b3c"}``."""
        names = {role: f"{role}-{uuid.uuid4().hex[:10]}" for role in partitions}
        create_topics(self.bootstrap_servers, {names[role]: n for role, n in partitions.items()})
        return names


@pytest.fixture(scope="session")
def broker() -> Iterator[TestBroker]:
    kind = os.environ.get("KINFERENCE_TEST_BROKER", "tansu")
    if kind == "kafka":
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer().with_kraft() as kafka:
            yield TestBroker(kafka.get_bootstrap_server(), "kafka")
    elif kind == "tansu":
        with EmbeddedBroker() as tansu:
            yield TestBroker(tansu.bootstrap_servers, "tansu")
    else:
        raise pytest.UsageError(f"KINFERENCE_TEST_BROKER must be 'tansu' or 'kafka', not {kind!r}")


@pytest.fixture
def unique_id() -> str:
    return uuid.uuid4().hex[:10]
