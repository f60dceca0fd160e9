"""``kinference serve`` as users run it: a separate process, configured by env vars and flags, stopped by SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import orjson
import pytest
from confluent_kafka.admin import AdminClient

from kinference.consumer.brokers.broker import free_port
from kinference.consumer.config import ServiceConfig
from tests.conftest import TEST_CONSUMER_PROPERTIES
from tests.integration.kafka_io import committed, produce, read

pytestmark = pytest.mark.integration


class ServeProcess:
    """``kinference serve`` in a child process whose stderr is collected line by line. Its metrics listen on a free
    port unless ``env`` names one: the default port, 9400, is one per machine, and the suite runs in parallel (two
    serve processes on it failed a CI run with 'Address already in use')."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        env = {"KINFERENCE_METRICS_PORT": str(free_port()), **(env or {})}
        self.process = subprocess.Popen([sys.executable, "-m", "kinference", "serve", *args],
                                        env={**os.environ, **env}, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.assigned = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)
            if "assigned" in line:
                self.assigned.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def terminate_and_wait(self, timeout_s: float = 60) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout_s)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def test_serve_process_answers_and_exits_zero_on_sigterm(broker, unique_id, tmp_path):
    topics = broker.topics(requests=2, replies=1, dead=1)
    group = f"cli-{unique_id}"
    config_file = tmp_path / "kinference.yaml"
    # Kafka properties as YAML numbers, as users write them: they reach librdkafka as strings.
    config_file.write_text(f"reply_topic: {topics['replies']}\nmax_batch_size: 8\nkafka_consumer:\n"
                           + "".join(f"  {k}: {v}\n" for k, v in TEST_CONSUMER_PROPERTIES.items()))
    env = {"KINFERENCE_BOOTSTRAP_SERVERS": broker.bootstrap_servers, "KINFERENCE_DEAD_LETTER_TOPIC": topics["dead"],
           "KINFERENCE_HANDLER": "echo"}
    serve = ServeProcess(["--config", str(config_file), "--request-topics", topics["requests"], "--group-id", group],
                         env)
    try:
        assert serve.assigned.wait(60), serve.log
        produced = produce(broker.bootstrap_servers, topics["requests"],
                           [(None, orjson.dumps(i), []) for i in range(100)])
        replies = read(broker.bootstrap_servers, topics["replies"], 100)
        assert sorted(orjson.loads(m.value())["result"] for m in replies) == list(range(100))
        assert serve.terminate_and_wait() == 0, serve.log
    finally:
        serve.kill()
    assert "received SIGTERM" in serve.log
    assert committed(broker.bootstrap_servers, group, list(produced.ends)) == dict(produced.ends)


def test_serve_rejects_bad_configuration_with_exit_code_2():
    result = subprocess.run(
        [sys.executable, "-m", "kinference", "serve", "--max-batch-size", "0",
         "--micro-batch-size", "many"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "--max-batch-size" in result.stderr and "--micro-batch-size" in result.stderr


def test_serve_with_workers_rejects_a_bad_archive_once_with_exit_code_2(tmp_path):
    """A TorchServe archive's batch settings are read with its handler; a broken archive fails in the supervisor,
    not in each of its workers until it gives up."""
    archive = tmp_path / "broken.mar"
    archive.write_bytes(b"not a zip")
    result = subprocess.run(
        [sys.executable, "-m", "kinference", "serve", "--workers", "2", "--no-metrics", "--handler", "torchserve",
         "--model", str(archive)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("broken.mar is neither a .mar") == 1, result.stderr


def test_serve_with_embedded_broker_on_defaults():
    serve = ServeProcess(["--embedded-broker", "--handler", "echo", "--kafka", "session.timeout.ms=6000"])
    try:
        assert serve.assigned.wait(60), serve.log
        bootstrap = re.search(r"embedded broker: --bootstrap-servers (\S+)", serve.log).group(1)
        produce(bootstrap, "kinference-requests", [(b"k", b'{"hello": "world"}', [])])
        (reply,) = read(bootstrap, "kinference-replies", 1)
        assert orjson.loads(reply.value()) == {"result": {"hello": "world"}} and reply.key() == b"k"
        assert serve.terminate_and_wait() == 0, serve.log
    finally:
        serve.kill()


def test_serve_rejects_an_unknown_librdkafka_property_with_exit_code_2():
    result = subprocess.run(
        [sys.executable, "-m", "kinference", "serve", "--handler", "echo", "--no-metrics",
         "--kafka", "no.such.property=1"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "Kafka client configuration was rejected" in result.stderr and "no.such.property" in result.stderr


def kinference(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kinference", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_topics_create_makes_the_topics_serve_uses(broker, unique_id):
    names = {"requests": f"in-a-{unique_id},in-b-{unique_id}", "replies": f"out-{unique_id}",
             "dead": f"dead-{unique_id}"}
    # The same settings serve reads: flags, KINFERENCE_* env vars, and the Kafka properties for the admin client.
    env = {"KINFERENCE_BOOTSTRAP_SERVERS": broker.bootstrap_servers, "KINFERENCE_DEAD_LETTER_TOPIC": names["dead"],
           "KINFERENCE_PARTITIONS": "3"}
    args = ["topics", "create", "--request-topics", names["requests"], "--reply-topic", names["replies"],
            "--reply-partitions", "2", "--replication-factor", "1", "--kafka", "client.id=topics"]
    first = kinference(*args, env=env)
    assert first.returncode == 0, first.stderr
    assert f"out-{unique_id}: created, 2 partitions" in first.stdout
    metadata = AdminClient({"bootstrap.servers": broker.bootstrap_servers}).list_topics(timeout=10).topics
    # One dead-letter partition by default, here as in compose and the k8s Job.
    expected = {f"in-a-{unique_id}": 3, f"in-b-{unique_id}": 3, f"out-{unique_id}": 2, f"dead-{unique_id}": 1}
    assert {name: len(metadata[name].partitions) for name in expected} == expected
    again = kinference(*args, env=env)
    assert again.returncode == 0 and again.stdout.count(": exists\n") == 4, again.stdout + again.stderr
    refused = kinference(*args, "--kafka", "group.id=x", env=env)
    assert refused.returncode == 2 and "group.id is set by --group-id" in refused.stderr


def test_topics_create_takes_a_serve_command_line_sets_topic_configs_and_reports_what_differs(broker, unique_id):
    replies, dead = f"out-{unique_id}", f"dead-{unique_id}"
    serve_line = ["--bootstrap-servers", broker.bootstrap_servers, "--request-topics", f"in-{unique_id}",
                  "--reply-topic", replies, "--dead-letter-topic", dead, "--handler", "echo", "--max-batch-size", "8",
                  "--group-id", "g", "--kafka-consumer", "fetch.wait.max.ms=10"]
    configs = ["--topic-config", "retention.ms=3600000", "--topic-config", "max.message.bytes=2000000"]
    first = kinference("topics", "create", *serve_line, "--partitions", "2", *configs)
    assert first.returncode == 0, first.stderr
    assert "note: ignored by topics create: --group-id, --handler, --kafka-consumer, --max-batch-size" in first.stderr
    assert first.stdout.count("created") == 3, first.stdout
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    from confluent_kafka.admin import ConfigResource

    (described,) = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, replies)]).values()
    assert described.result(10)["retention.ms"].value == "3600000"
    # Asked again with other settings: nothing changes, and each difference is reported.
    again = kinference("topics", "create", *serve_line, "--partitions", "4", "--topic-config", "retention.ms=60000",
                       "--topic-config", "max.message.bytes=2000000")
    assert again.returncode == 0, again.stderr
    assert f"in-{unique_id}: exists and differs (left as it is): 2 partitions, not 4; retention.ms=3600000, not " \
           "60000" in again.stdout, again.stdout
    assert len(admin.list_topics(timeout=10).topics[f"in-{unique_id}"].partitions) == 2
    # max.message.bytes must hold the dead letter of a maximal request, and is refused before anything is made.
    small = kinference("topics", "create", *serve_line, "--topic-config", "max.message.bytes=100000")
    assert small.returncode == 2 and "must hold the dead letter of a maximal request" in small.stderr
    large = kinference("topics", "create", *serve_line, "--max-request-bytes", "1500000",
                       "--kafka-producer", "message.max.bytes=2000000")
    # What it must hold: the value, its headers and its key, with kinference's own headers.
    needed = ServiceConfig(max_request_bytes=1_500_000,
                           kafka_producer={"message.max.bytes": "2000000"}).dead_letter_max_bytes
    assert large.returncode == 1 and f"add --topic-config max.message.bytes={needed}" in large.stderr


def test_healthcheck_follows_the_port_the_service_was_given(broker, unique_id):
    topics = broker.topics(requests=1, replies=1, dead=1)
    port = free_port()
    # The port comes from a flag, the host from the environment: the probe must read both from the process.
    serve = ServeProcess(["--handler", "echo", "--request-topics", topics["requests"], "--reply-topic",
                          topics["replies"], "--dead-letter-topic", topics["dead"], "--group-id", f"hc-{unique_id}",
                          "--bootstrap-servers", broker.bootstrap_servers, "--metrics-port", str(port)],
                         {"KINFERENCE_METRICS_HOST": "127.0.0.1"})
    try:
        assert serve.assigned.wait(60), serve.log
        healthy = kinference("healthcheck", "--pid", str(serve.process.pid))
        assert healthy.returncode == 0, healthy.stderr
        assert orjson.loads(healthy.stdout)["ok"] is True
        # --ready: /readyz on the same derived address (compose's readiness check); the member has its partitions.
        ready = kinference("healthcheck", "--ready", "--pid", str(serve.process.pid))
        assert ready.returncode == 0, ready.stderr
        assert "group_joined" in ready.stdout
        assert serve.terminate_and_wait() == 0, serve.log
    finally:
        serve.kill()
    gone = kinference("healthcheck", "--url", f"http://127.0.0.1:{port}/healthz", "--timeout", "2")
    assert gone.returncode == 1
    not_serve = kinference("healthcheck", "--pid", str(os.getpid()))
    assert not_serve.returncode == 2 and "is not kinference serve" in not_serve.stderr
