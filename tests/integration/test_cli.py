"""``kinfer serve`` as users run it: a separate process, configured by env vars and flags, stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import orjson
import pytest

from tests.conftest import TEST_CONSUMER_PROPERTIES
from tests.integration.kafka_io import committed, produce, read

pytestmark = pytest.mark.integration


def test_serve_process_answers_and_exits_zero_on_sigterm(broker, unique_id, tmp_path):
    topics = broker.topics(requests=2, replies=1, dead=1)
    group = f"cli-{unique_id}"
    config_file = tmp_path / "kinfer.yaml"
    config_file.write_text(f"reply_topic: {topics['replies']}\nmax_batch_size: 8\nkafka:\n"
                           + "".join(f"  {k}: '{v}'\n" for k, v in TEST_CONSUMER_PROPERTIES.items()))
    env = {**os.environ, "KINFER_BOOTSTRAP_SERVERS": broker.bootstrap_servers,
           "KINFER_DEAD_LETTER_TOPIC": topics["dead"], "KINFER_HANDLER": "echo"}
    process = subprocess.Popen(
        [sys.executable, "-m", "consumer.cli", "serve", "--config", str(config_file),
         "--request-topics", topics["requests"], "--group-id", group],
        env=env, stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []
    assigned = threading.Event()

    def pump() -> None:
        for line in process.stderr:
            lines.append(line)
            if "assigned" in line:
                assigned.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert assigned.wait(60), "".join(lines)
        produced = produce(broker.bootstrap_servers, topics["requests"],
                           [(None, orjson.dumps(i), []) for i in range(100)])
        replies = read(broker.bootstrap_servers, topics["replies"], 100)
        assert sorted(orjson.loads(m.value())["result"] for m in replies) == list(range(100))
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, "".join(lines)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert any("received SIGTERM" in line for line in lines)
    assert committed(broker.bootstrap_servers, group, list(produced.ends)) == dict(produced.ends)


def test_serve_rejects_bad_configuration_with_exit_code_2():
    result = subprocess.run(
        [sys.executable, "-m", "consumer.cli", "serve", "--max-batch-size", "0", "--micro-batch-size", "many"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "--max-batch-size" in result.stderr and "--micro-batch-size" in result.stderr
