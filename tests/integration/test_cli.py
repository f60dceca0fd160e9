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

from tests.conftest import TEST_CONSUMER_PROPERTIES
from tests.integration.kafka_io import committed, produce, read

pytestmark = pytest.mark.integration


class ServeProcess:
    """``kinference serve`` in a child process whose stderr is collected line by line."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "kinference.consumer.cli", "serve", *args],
                                        env={**os.environ, **(env or {})}, stderr=subprocess.PIPE, text=True)
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
    config_file.write_text(f"reply_topic: {topics['replies']}\nmax_batch_size: 8\nkafka:\n"
                           + "".join(f"  {k}: '{v}'\n" for k, v in TEST_CONSUMER_PROPERTIES.items()))
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
        [sys.executable, "-m", "kinference.consumer.cli", "serve", "--max-batch-size", "0",
         "--micro-batch-size", "many"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "--max-batch-size" in result.stderr and "--micro-batch-size" in result.stderr


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
        [sys.executable, "-m", "kinference.consumer.cli", "serve", "--handler", "echo", "--metrics-port", "-1",
         "--kafka", "no.such.property=1"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "Kafka client configuration was rejected" in result.stderr and "no.such.property" in result.stderr
