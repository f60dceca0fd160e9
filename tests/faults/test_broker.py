"""Broker faults: not reachable at start, restarted mid-run (memory storage: state lost, producer
fenced), restarted mid-run with durable S3 storage (nothing lost). Each test runs its own Tansu."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import orjson
import pytest

from kinference import protocol
from kinference.consumer.brokers.broker import EmbeddedBroker
from kinference.consumer.brokers.ports import free_port
from kinference.consumer.config import ServiceConfig
from kinference.consumer.ops.topics import create_topics
from kinference.consumer.service import Service
from tests.conftest import TEST_CONSUMER_PROPERTIES
from tests.integration.kafka_io import committed, headers_of, produce, read
from tests.processes import stop, until_answering

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.embedded_broker]

TOPICS = {"requests": 3, "replies": 1, "dead": 1}


def config_for(bootstrap: str, group: str, **overrides) -> ServiceConfig:
    values = {"bootstrap_servers": bootstrap, "request_topics": ["requests"], "reply_topic": "replies",
              "dead_letter_topic": "dead", "group_id": group, "handler": "echo",
              "kafka_consumer": TEST_CONSUMER_PROPERTIES, "commit_interval_ms": 200, "metrics_host": "127.0.0.1",
              "metrics": True, "metrics_port": 0}
    return ServiceConfig(**{**values, **overrides})


def readyz(service: Service) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{service.endpoints.port}/readyz", timeout=5) as response:
            return response.status, orjson.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, orjson.loads(error.read())


def ask(bootstrap: str, values: list, timeout_s: float = 60.0) -> dict[bytes, dict]:
    """Produce requests with correlation ids and wait for all their replies (read from the start)."""
    ids = [f"q-{time.monotonic_ns()}-{i}".encode() for i in range(len(values))]
    produce(bootstrap, "requests", [(cid, orjson.dumps(v), [(protocol.CORRELATION_ID, cid)])
                                    for cid, v in zip(ids, values, strict=True)])
    deadline = time.monotonic() + timeout_s
    replies: dict[bytes, dict] = {}
    while time.monotonic() < deadline and len(replies) < len(ids):
        for message in read(bootstrap, "replies", len(ids), timeout_s=2.0):
            cid = headers_of(message)[protocol.CORRELATION_ID]
            if cid in ids:
                replies[cid] = orjson.loads(message.value())
    return replies


def test_broker_unreachable_at_start_then_service_starts_when_it_comes():
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    with Service(config_for(bootstrap, "late-broker")) as service:
        time.sleep(2.0)
        status, body = readyz(service)
        assert status == 503 and body["checks"]["broker_reachable"] is False
        assert body["checks"]["model_loaded"] is True and service.healthy  # alive, just not ready
        with EmbeddedBroker(port=port):
            create_topics(bootstrap, TOPICS)
            assert service.wait_ready(60), "did not join once the broker came up"
            replies = ask(bootstrap, [{"n": 1}])
            assert list(replies.values()) == [{"result": {"n": 1}}]
            assert readyz(service)[0] == 200
            service.stop()


def test_broker_restart_losing_its_state_fences_the_producer_which_is_replaced():
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    broker = EmbeddedBroker(port=port).start()
    try:
        create_topics(bootstrap, TOPICS)
        # librdkafka gives up a record after message.timeout.ms; no successful delivery for longer than that
        # means the producer is dead (the stall timeout must exceed it).
        config = config_for(bootstrap, "restart-memory", kafka_producer={"message.timeout.ms": "3000"},
                            producer_stall_timeout_s=5)
        with Service(config) as service:
            assert service.wait_ready(30)
            assert list(ask(bootstrap, [{"before": 1}]).values()) == [{"result": {"before": 1}}]
            broker.stop()
            time.sleep(1.0)
            broker = EmbeddedBroker(port=port).start()  # memory storage: topics, offsets, producer ids gone
            create_topics(bootstrap, TOPICS)
            replies = ask(bootstrap, [{"after": i} for i in range(20)], timeout_s=90)
            assert sorted(r["result"]["after"] for r in replies.values()) == list(range(20))
            assert service.healthy
            replaced = service.metrics.producer_replacements._value.get()
            assert replaced >= 1, "the fenced idempotent producer should have been replaced"
    finally:
        broker.stop()


@pytest.fixture
def s3_server(tmp_path):
    """A local S3 (moto) for Tansu's durable storage; stopped by PID."""
    moto = shutil.which("moto_server")
    if moto is None:
        pytest.skip("moto_server not installed (pip install 'moto[server]')")
    port = free_port()
    process = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
    try:
        import boto3

        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                          aws_secret_access_key="test")
        until_answering(process, lambda: s3.create_bucket(Bucket="tansu"), pause_s=0.2)
        yield env
    finally:
        stop(process)


def test_broker_restart_with_durable_storage_loses_nothing(s3_server, monkeypatch):
    """Load runs through a broker restart; every request is answered: its offset is committed (the
    commit rule: only acknowledged replies commit) and the service counted an acknowledged reply."""
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)  # read by the Tansu child process
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    total, batch = 600, 50
    broker = EmbeddedBroker(port=port, storage="s3://tansu/").start()
    try:
        create_topics(bootstrap, TOPICS)
        config = config_for(bootstrap, "restart-s3")
        with Service(config) as service:
            assert service.wait_ready(30)
            ends: Counter = Counter()

            def load() -> None:
                for start in range(0, total, batch):
                    # Retried through the restart within message.timeout.ms; idempotence keeps the retries
                    # from writing requests twice, so delivery reports give the exact end offsets.
                    produced = produce(bootstrap, "requests", [(None, orjson.dumps(i), [])
                                                               for i in range(start, start + batch)],
                                       **{"message.timeout.ms": "60000", "enable.idempotence": "true"})
                    ends.update(produced.ends)
                    time.sleep(0.05)

            producer_thread = threading.Thread(target=load)
            producer_thread.start()
            time.sleep(0.4)
            broker.stop()
            time.sleep(1.0)
            broker = EmbeddedBroker(port=port, storage="s3://tansu/").start()
            producer_thread.join(120)
            assert sum(ends.values()) == total

            deadline = time.monotonic() + 90
            while committed(bootstrap, config.group_id, list(ends)) != dict(ends) and time.monotonic() < deadline:
                time.sleep(1.0)
            assert committed(bootstrap, config.group_id, list(ends)) == dict(ends), "not every request answered"
            assert service.metrics.replies.labels("ok")._value.get() >= total  # duplicates allowed, loss not
            assert service.healthy
    finally:
        broker.stop()


def test_a_broker_paused_longer_than_the_delivery_timeout_loses_nothing_and_dead_letters_nothing():
    """SIGSTOP the broker for 8 s while replies are being produced, with librdkafka's delivery timeout at 3 s:
    each reply in the air fails with _MSG_TIMED_OUT. That is not the record's fault: it is produced again with
    backoff, never dead-lettered. After SIGCONT every request is answered and committed.

    Seen on Tansu: after the pause the same idempotent producer kept timing out (Tansu does not let it bump its
    epoch past the lost sequence), so it is replaced once its stall reaches the stall timeout (33 s here: the
    delivery timeout plus 30 s), and the new producer delivers at once. The member's session also expired during
    the pause, so the group re-served some requests (at-least-once duplicates)."""
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    broker = EmbeddedBroker(port=port).start()
    try:
        create_topics(bootstrap, TOPICS)
        config = config_for(bootstrap, "paused-broker", handler="tests.faults.handlers:TaggedEcho",
                            handler_options={"delay_s": 0.2}, max_batch_size=4,
                            kafka_producer={"message.timeout.ms": "3000"})
        total = 60  # 20 requests/s: answers go on for 3 s, across the pause
        with Service(config) as service:
            assert service.wait_ready(30)
            produced = produce(bootstrap, "requests", [(None, orjson.dumps({"seq": i}), []) for i in range(total)])
            time.sleep(1.0)
            os.kill(broker.pid, signal.SIGSTOP)  # the broker started by this test, by PID
            try:
                time.sleep(8.0)
            finally:
                os.kill(broker.pid, signal.SIGCONT)
            deadline = time.monotonic() + 90
            ends = dict(produced.ends)
            while committed(bootstrap, config.group_id, list(ends)) != ends and time.monotonic() < deadline:
                time.sleep(1.0)
            replies = read(bootstrap, "replies", total, timeout_s=30)
            dead = read(bootstrap, "dead", 1, timeout_s=2)
            timed_out = service.metrics.delivery_failures.labels("reply")._value.get()
            replaced = service.metrics.producer_replacements._value.get()
            assert service.healthy, service.problems()
        print(f"\npaused broker: {len(replies)} replies for {total} requests, {timed_out:.0f} reply deliveries timed "
              f"out and were produced again, {replaced:.0f} producer replacements, {len(dead)} dead letters")
        assert committed(bootstrap, config.group_id, list(ends)) == ends, "not every request answered"
        assert {orjson.loads(m.value())["result"]["value"]["seq"] for m in replies} == set(range(total))
        assert dead == [] and replaced <= 1
        assert timed_out > 0, "no reply was in the air during the pause: the test did not exercise the retry"
    finally:
        broker.stop()
