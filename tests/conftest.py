"""Shared fixtures: one real broker per test session (per pytest-xdist worker), unique topic and group names per test.

``KINFERENCE_TEST_BROKER`` picks the broker:
- ``tansu`` (default): the embedded Tansu broker, pip-only.
- ``kafka``: Apache Kafka 4.x in KRaft mode, from Maven Central (``kinference.consumer.brokers.apache_kafka``): needs a
  JDK 17+ and Maven, else the tests that need a broker skip and say why.
- ``kafka-docker``: Apache Kafka in the image that deploy/docker-compose.yml runs, started by testcontainers
  (needs a Docker engine).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from kinference.consumer.brokers.broker import LOW_LATENCY_CONSUMER, EmbeddedBroker, free_port
from kinference.consumer.ops.topics import create_topics
from kinference.errors import BrokerError

BROKER_KIND = os.environ.get("KINFERENCE_TEST_BROKER", "tansu")

# Consumer settings that keep tests fast: a dead member is noticed in 6 s (Tansu also holds a group join for
# ~session.timeout.ms / 2), and on Tansu a fetch is answered only after fetch.wait.max.ms
# (consumer.broker.LOW_LATENCY_CONSUMER). Apache Kafka wakes a waiting fetch: there librdkafka's default is kept.
FETCH_PROPERTIES = LOW_LATENCY_CONSUMER if BROKER_KIND == "tansu" else {}
TEST_CONSUMER_PROPERTIES = {
    "session.timeout.ms": "6000",
    "heartbeat.interval.ms": "2000",
    **FETCH_PROPERTIES,
}
NO_THREAD_DIES = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
"""A module's mark: a thread of the service that dies of an exception fails the test, which a warning alone would not
(a clean stop once raised SystemError out of the consumer's close, and only a warning said so)."""


@dataclass(frozen=True)
class TestBroker:
    bootstrap_servers: str
    kind: str

    def topics(self, **partitions: int) -> dict[str, str]:
        """Create uniquely named topics: ``topics(requests=3)`` -> ``{"requests": "requests-1a2b3c"}``."""
        names = {role: f"{role}-{uuid.uuid4().hex[:10]}" for role in partitions}
        create_topics(self.bootstrap_servers, {names[role]: n for role, n in partitions.items()})
        return names


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fault tests first, then integration, then unit tests: pytest-xdist hands tests out in this order, so the
    minute-long fault tests start at once instead of ending the run alone. Tests that start a Tansu broker of
    their own (``embedded_broker``) skip when the suite runs on another broker."""
    def rank(item: pytest.Item) -> int:
        return 0 if item.get_closest_marker("faults") else 1 if item.get_closest_marker("integration") else 2

    items.sort(key=rank)
    if BROKER_KIND != "tansu":
        skip = pytest.mark.skip(reason="starts a Tansu broker of its own; the suite runs on "
                                       f"KINFERENCE_TEST_BROKER={BROKER_KIND}")
        for item in items:
            if item.get_closest_marker("embedded_broker"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def broker() -> Iterator[TestBroker]:
    if BROKER_KIND == "kafka":
        from kinference.consumer.brokers.apache_kafka import ApacheKafkaBroker, broker_jars

        try:
            broker_jars()
        except BrokerError as exc:
            pytest.skip(f"KINFERENCE_TEST_BROKER=kafka: {exc}")
        with ApacheKafkaBroker() as kafka:
            yield TestBroker(kafka.bootstrap_servers, "kafka")
    elif BROKER_KIND == "kafka-docker":
        with apache_kafka_container() as bootstrap_servers:
            yield TestBroker(bootstrap_servers, "kafka")
    elif BROKER_KIND == "tansu":
        with EmbeddedBroker() as tansu:
            yield TestBroker(tansu.bootstrap_servers, "tansu")
    else:
        raise pytest.UsageError("KINFERENCE_TEST_BROKER must be 'tansu', 'kafka' or 'kafka-docker', "
                                f"not {BROKER_KIND!r}")


@contextmanager
def apache_kafka_container(start_timeout_s: float = 120.0) -> Iterator[str]:
    """One Apache Kafka broker in KRaft mode, the image that deploy/docker-compose.yml runs, on a free host port.

    The port is bound before the start so that the broker can advertise it (clients connect to what the
    broker advertises). Needs a Docker engine."""
    from testcontainers.core.container import DockerContainer

    compose = yaml.safe_load((Path(__file__).parents[1] / "deploy" / "docker-compose.yml").read_text())
    port = free_port()
    container = DockerContainer(compose["services"]["kafka"]["image"]).with_bind_ports(9092, port)
    host = container.get_container_host_ip()
    settings = {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
        "KAFKA_LISTENERS": "PLAINTEXT://:9092,CONTROLLER://:9093",
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://{host}:{port}",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
    }
    for key, value in settings.items():
        container.with_env(key, value)
    with container:
        bootstrap_servers = f"{host}:{port}"
        admin = AdminClient({"bootstrap.servers": bootstrap_servers})
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                admin.list_topics(timeout=2)
                break
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
        yield bootstrap_servers


@pytest.fixture(scope="session")
def st_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``st_model(layout)``: the directory of a tiny sentence-transformers model of that layout
    (tests/models.py ``ST_LAYOUTS``), built once per session (per pytest-xdist worker)."""
    from tests.models import build_st_model

    built: dict[str, Path] = {}

    def model(layout: str) -> Path:
        if layout not in built:
            built[layout] = build_st_model(tmp_path_factory.mktemp("st") / layout, layout)
        return built[layout]

    return model


@pytest.fixture
def unique_id() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture
def spans():
    """(a tracer provider, its in-memory exporter): every span the provider ends, kept for the test to read."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The slowest decode each hostile-input fuzz pass saw (tests/unit/consumer/path/test_request_hostile.py), when
    it ran."""
    fuzz = sys.modules.get("tests.unit.consumer.path.test_request_hostile")
    if fuzz is not None:
        for line in fuzz.slowest_lines():
            terminalreporter.write_line(line)
