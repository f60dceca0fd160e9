"""Schema Registry value formats served through a real broker: requests written with the producer's own schema,
replies read back as ``kinference.Reply`` records, a malformed record answered with an error reply and
dead-lettered.

The registry is confluent-kafka's in-memory one (``mock://``), shared by the test's producer and the service (each
mock client otherwise has its own store). ``test_a_real_schema_registry`` runs Confluent's Schema Registry in
Docker and skips where there is none."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import pytest
import yaml
from confluent_kafka.schema_registry import SchemaRegistryClient

from kinference import protocol
from kinference.consumer.brokers.broker import free_port
from kinference.consumer.service import Service
from tests.conftest import apache_kafka_container
from tests.integration.kafka_io import headers_of, produce, read, service_config
from tests.schemas import Producer

pytestmark = pytest.mark.integration

SCHEMA_REGISTRY_IMAGE = "confluentinc/cp-schema-registry:8.1.0"


def serve_texts(bootstrap: str, topics: dict[str, str], value_format: str, registry: SchemaRegistryClient,
                registry_url: str, **overrides) -> tuple[dict, list]:
    """Serve three texts and one malformed record with the echo handler; (replies by key, dead letters)."""
    producer = Producer(value_format, registry)
    records = [(f"t{i}".encode(), producer.request(topics["requests"], text), [])
               for i, text in enumerate(["kafka", "schema registry", "avro"])]
    records.append((b"malformed", b"\x00\x00\x00\x00\x01 not a record", []))
    config = service_config(bootstrap, topics, value_format=value_format, schema_registry_url=registry_url,
                            **overrides)
    with Service(config) as service:
        assert service.wait_ready(30)
        produce(bootstrap, topics["requests"], records)
        replies = {m.key(): m for m in read(bootstrap, topics["replies"], len(records))}
        dead = read(bootstrap, topics["dead"], 1)
    return replies, dead


def check(replies: dict, dead: list, producer: Producer, topic: str) -> None:
    for i, text in enumerate(["kafka", "schema registry", "avro"]):
        message = replies[f"t{i}".encode()]
        reply = producer.reply(topic, message.value(), message.headers())
        result = reply["result"] if producer.value_format == "jsonschema" else orjson.loads(reply["result"])
        assert reply["status"] == "ok" and result == {"text": text}
        assert headers_of(message)[protocol.STATUS] == b"ok"
    malformed = replies[b"malformed"]
    reply = producer.reply(topic, malformed.value(), malformed.headers())
    assert reply["status"] == "error" and reply["error"]["code"] == "bad_request"
    assert headers_of(malformed)[protocol.ERROR_CODE] == b"bad_request"
    assert [m.key() for m in dead] == [b"malformed"]
    assert headers_of(dead[0])[protocol.ERROR_CODE] == b"bad_request"


@pytest.mark.parametrize(("value_format", "schema_id_location"), [("avro", "prefix"), ("protobuf", "header"),
                                                                  ("jsonschema", "prefix")])
def test_schema_registry_requests_get_replies_in_the_same_format(broker, monkeypatch, value_format,
                                                                 schema_id_location):
    topics = broker.topics(requests=2, replies=1, dead=1)
    url = f"mock://{uuid.uuid4().hex}"
    registry = SchemaRegistryClient.new_client({"url": url})
    monkeypatch.setattr(SchemaRegistryClient, "new_client", staticmethod(lambda conf: registry))
    replies, dead = serve_texts(broker.bootstrap_servers, topics, value_format, registry, url,
                                schema_id_location=schema_id_location)
    check(replies, dead, Producer(value_format, registry), topics["replies"])
    located = [("__value_schema_id" in headers_of(m)) for m in replies.values()]
    assert located == [schema_id_location == "header"] * len(replies)


def _docker() -> str | None:
    """None when a Docker engine answers, else why not."""
    if shutil.which("docker") is None:
        return "no docker CLI"
    try:
        result = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer in 30 s"
    if result.returncode != 0:
        return f"`docker info` failed: {result.stderr.strip()[:200]}"
    return _pullable(SCHEMA_REGISTRY_IMAGE, _kafka_image())


def _kafka_image() -> str:
    compose = yaml.safe_load((Path(__file__).parents[2] / "deploy" / "docker-compose.yml").read_text())
    return compose["services"]["kafka"]["image"]


def _pullable(*images: str) -> str | None:
    """None when each image is there or can be pulled; else why not (a machine whose Docker reaches no registry,
    as where Docker Hub is not reachable)."""
    for image in images:
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=30).returncode == 0:
            continue
        try:
            pulled = subprocess.run(["docker", "pull", "-q", image], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return f"`docker pull {image}` did not finish in 120 s"
        if pulled.returncode != 0:
            return f"`docker pull {image}` failed: {pulled.stderr.strip()[:200]}"
    return None


@contextmanager
def schema_registry(kafka_bootstrap: str, start_timeout_s: float = 120.0) -> Iterator[str]:
    """Confluent's Schema Registry on the host network (it stores schemas in the Kafka at ``kafka_bootstrap``)."""
    from testcontainers.core.container import DockerContainer

    port = free_port()
    container = (DockerContainer(SCHEMA_REGISTRY_IMAGE).with_kwargs(network_mode="host")
                 .with_env("SCHEMA_REGISTRY_HOST_NAME", "localhost")
                 .with_env("SCHEMA_REGISTRY_LISTENERS", f"http://127.0.0.1:{port}")
                 .with_env("SCHEMA_REGISTRY_KAFKASTORE_BOOTSTRAP_SERVERS", f"PLAINTEXT://{kafka_bootstrap}"))
    with container:
        url = f"http://127.0.0.1:{port}"
        client = SchemaRegistryClient({"url": url})
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                client.get_subjects()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        yield url


@pytest.mark.slow
def test_a_real_schema_registry():
    """The same exchange against Confluent's Schema Registry and Apache Kafka, both in Docker: the registry
    stores its schemas in Kafka, so it cannot use the embedded Tansu broker of the other tests."""
    reason = _docker()
    if reason:
        pytest.skip(f"needs a Docker engine to run Confluent's Schema Registry ({SCHEMA_REGISTRY_IMAGE}): {reason}")
    from kinference.consumer.ops.topics import create_topics

    with apache_kafka_container() as bootstrap, schema_registry(bootstrap) as url:
        topics = {role: f"{role}-{uuid.uuid4().hex[:10]}" for role in ("requests", "replies", "dead")}
        create_topics(bootstrap, dict.fromkeys(topics.values(), 1))
        registry = SchemaRegistryClient({"url": url})
        replies, dead = serve_texts(bootstrap, topics, "avro", registry, url)
        check(replies, dead, Producer("avro", registry), topics["replies"])
        assert f"{topics['replies']}-value" in registry.get_subjects()
